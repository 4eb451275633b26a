"""Where a verifier pass's time goes: torch's profiler over 1-token and 5-token passes of the
default verifier, by op (self CPU time), in the given dtype. Writes bench/results/<name>.json
(default pass-profile).

    .venv/bin/python bench/pass_profile.py [--dtype auto] [--reps 20] [--tokens 1,2,3,5] [--name pass-profile]"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench import machine  # noqa: E402


def profile_pass(runner, tokens: int, reps: int) -> dict:
    """Mean ms per pass, in all and by op (the ten dearest by self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    ctx = list(range(100, 300))
    runner.sync(["p"], [ctx + [500] * tokens], [0])
    runner.prefill(["p"], [ctx])
    new = [ctx[-1]] + [500 + i for i in range(tokens - 1)]
    for _ in range(3):  # warm-up
        runner.sync(["p"], [ctx + new[1:]], [tokens])
        runner.model.logits(runner.forward(["p"], [new])[0][0])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            runner.sync(["p"], [ctx + new[1:]], [tokens])
            runner.model.logits(runner.forward(["p"], [new])[0][0])
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / reps
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
    return {"ms_per_pass": round(total, 2), "ops_per_pass": round(sum(e.count for e in events) / reps),
            "by_op_ms": {e.key: round(e.self_cpu_time_total / 1e3 / reps, 3) for e in top}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,5", help="tokens per pass, comma-separated")
    ap.add_argument("--name", default="pass-profile", help="results file stem under bench/results/")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from specdec.models.layouts import maybe_tune
    from specdec.models.loader import load_model
    from specdec.models.runner import ModelRunner

    model = load_model("default", "cpu", a.dtype, progress=False)
    maybe_tune(model)
    runner = ModelRunner(model, 2, 1024, prefix_caching=False)
    with torch.no_grad():
        out = {"dtype": a.dtype, "threads": a.threads, "torch": torch.__version__, "machine": machine(),
               # the fastest of three profiles: this VM's speed drifts by tens of percent over minutes
               "passes": {t: min((profile_pass(runner, t, a.reps) for _ in range(3)), key=lambda p: p["ms_per_pass"])
                          for t in (int(x) for x in a.tokens.split(","))}}
    path = ROOT / "bench" / "results" / f"{a.name}.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
