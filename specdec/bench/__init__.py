"""`specdec bench`: speculation vs plain decoding on the embedded default, from real runs."""


def main(argv=None):
    from specdec.bench.run import main as _main

    return _main(argv)
