"""`specdec bench`: speculation vs plain decoding on the embedded default, from real runs."""


def main(argv=None):
    from specdec.bench.run import main as _main

    return _main(argv)


def machine() -> dict:
    """Which machine a result comes from: the CPU and the kernel paths it runs (results from
    machines with and without AMX or AVX-512 differ by tens of percent)."""
    import os

    from specdec.models import kernels
    from specdec.models.layouts import cpu_info

    out = {"cpu": cpu_info()[0], "cpus": os.cpu_count()}
    if kernels.load():
        import torch

        out |= {"matmul": kernels.isa(), "attention": torch.ops.specdec_attention.attend_isa()}
    return out
