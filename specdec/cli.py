"""`specdec` command line: fetch, generate, bench, train-draft, plan."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options, with EngineConfig's defaults and descriptions (one configuration)."""
    from specdec.config import EngineConfig

    f = EngineConfig.model_fields
    p.add_argument("--verifier", default=f["verifier"].default, help=f["verifier"].description)
    p.add_argument("--draft", default=f["draft"].default, help=f["draft"].description)
    p.add_argument("--k", type=int, default=f["num_speculative_tokens"].default, help=f["num_speculative_tokens"].description)
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=f["adaptive"].default,
                   help=f["adaptive"].description)
    p.add_argument("--device", default=f["device"].default, help=f["device"].description)
    p.add_argument("--dtype", default=f["dtype"].default, help=f["dtype"].description)
    p.add_argument("--enforce-eager", action="store_true", help=f["enforce_eager"].description)
    p.add_argument("--threads", type=int, default=f["num_threads"].default, help=f["num_threads"].description)
    p.add_argument("--max-model-len", type=int, default=f["max_model_len"].default, help=f["max_model_len"].description)


def engine_config(a: argparse.Namespace):
    from specdec.config import EngineConfig

    return EngineConfig(verifier=a.verifier, draft="none" if a.k == 0 and a.draft == "default" else a.draft,
                        num_speculative_tokens=a.k, adaptive=a.adaptive and a.k > 0, device=a.device, dtype=a.dtype,
                        enforce_eager=a.enforce_eager, num_threads=a.threads, max_model_len=a.max_model_len, max_seqs=4)


def cmd_fetch(a) -> int:
    from specdec.models.default import default_verifier_dir

    print(default_verifier_dir(progress=True))
    return 0


def cmd_generate(a) -> int:
    from specdec.engine import SpecEngine
    from specdec.sampling import SamplingParams

    engine = SpecEngine.from_config(engine_config(a))
    prompt = [{"role": "user", "content": a.prompt}] if not a.raw else a.prompt
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, stop=a.stop or [], logprobs=a.logprobs)
    prediction = Path(a.prediction_file).read_text() if a.prediction_file else None
    c = engine.generate([prompt], params, predictions=[prediction])[0]
    m = c.metrics.to_dict()
    if a.json:
        print(json.dumps(c.to_dict()))
    else:
        print(c.text)
        print("\n--- speculation ---", file=sys.stderr)
        for k in ("num_output_tokens", "num_drafted", "num_accepted", "acceptance_rate", "mean_accepted_length",
                  "accepted_per_position", "num_prediction_accepted", "num_verifier_passes", "tokens_per_s", "ttft_s",
                  "ms_per_output_token"):
            print(f"{k:>22}: {m[k]}", file=sys.stderr)
    return 0


PASSTHROUGH = {"bench": "specdec.bench", "train-draft": "specdec.train_draft", "plan": "specdec.plan"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:  # these parse their own options
        import importlib

        return importlib.import_module(PASSTHROUGH[argv[0]]).main(argv[1:]) or 0
    ap = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch", help="download and convert the embedded default verifier").set_defaults(fn=cmd_fetch)
    g = sub.add_parser("generate", help="generate with speculative decoding in this process")
    _engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true", help="use the prompt as-is instead of the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's log-probability and its N likeliest alternatives")
    g.add_argument("--prediction-file", metavar="PATH",
                   help="text the answer is expected to repeat (a file to edit): drafts where the output meets it")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(fn=cmd_generate)
    sub.add_parser("bench", help="speculation benchmark (specdec bench --help)")
    sub.add_parser("train-draft", help="make data and train the default draft head (specdec train-draft --help)")
    sub.add_parser("plan", help="size draft/verifier pools and price output (specdec plan --help)")
    a = ap.parse_args(argv)
    return a.fn(a) or 0


if __name__ == "__main__":
    sys.exit(main())
