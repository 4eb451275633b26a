"""Prefix caching, measured on the verifier alone (127.0.0.1 is not even needed: no server).

    .venv/bin/python bench/prefix_cache.py [--tiny] [--reps 5]

Prefills what a verifier replica sees when users arrive: 16 chat prompts at once (serve_load's
questions, so every prompt starts with the chat template's system prompt), and one new question
after earlier requests have ended, with prefix caching off and on, alternating, on the same runner.
Prints a table and writes bench/results/prefix_cache[-tiny].json."""
from __future__ import annotations

import argparse
import json
import statistics as st
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from serve_load import QUESTIONS  # noqa: E402  (bench/ is on sys.path when run as a script)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tiny", action="store_true", help="tiny random model instead of the default verifier")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(2)
    from specdec.config import EngineConfig
    from specdec.engine import build_verifier
    from specdec.models.layouts import maybe_tune
    from specdec.models.loader import load_tokenizer
    from specdec.tokenizer import TextTokenizer

    spec = "tiny" if a.tiny else "default"
    runner = build_verifier(EngineConfig(verifier=spec, max_seqs=32, progress=False)).runner
    maybe_tune(runner.model)
    tok = TextTokenizer(load_tokenizer(spec, False))
    prompts = [tok.chat([{"role": "user", "content": q}]) for q in QUESTIONS * 2]
    others = [tok.chat([{"role": "user", "content": f"Question {i}: why is the sky blue?"}]) for i in range(2 * a.reps)]
    times: dict[tuple[str, bool], list[float]] = {}
    reused: dict[bool, int] = {}
    n = 0

    def timed(case: str, caching: bool, ps: list[list[int]]) -> None:
        nonlocal n
        runner.prefix_caching = caching
        ids = [f"s{n + i}" for i in range(len(ps))]
        n += len(ps)
        before = runner.prefix_tokens_reused
        t0 = time.perf_counter()
        runner.catch_up(ids, ps, [1] * len(ps))
        times.setdefault((case, caching), []).append(time.perf_counter() - t0)
        reused[caching] = runner.prefix_tokens_reused - before
        for s in ids:
            runner.free(s)

    def reset() -> None:  # nothing cached: users arriving at a fresh replica
        runner.cached.clear()

    timed("16 users at once", False, prompts)  # warm-up
    for rep in range(a.reps):
        for caching in ((False, True) if rep % 2 == 0 else (True, False)):
            reset()
            timed("16 users at once, cold replica", caching, prompts)
            timed("1 user after an earlier request", caching, [others[2 * rep + caching]])  # a question not seen yet
    rows = []
    for case in ("16 users at once, cold replica", "1 user after an earlier request"):
        off, on = st.median(times[(case, False)]), st.median(times[(case, True)])
        rows.append({"case": case, "off_ms": 1000 * off, "on_ms": 1000 * on, "speedup": off / on,
                     "off_ms_reps": [1000 * t for t in times[(case, False)]],
                     "on_ms_reps": [1000 * t for t in times[(case, True)]]})
    lines = ["| prefill | caching off ms | caching on ms | speedup |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['off_ms']:.0f} | {r['on_ms']:.0f} | {r['speedup']:.2f}x |" for r in rows]
    print("\n".join(lines))
    out = ROOT / "bench" / "results" / f"prefix_cache{'-tiny' if a.tiny else ''}.json"
    out.write_text(json.dumps({"rows": rows, "table": lines, "prompt_tokens": [len(p) for p in prompts],
                               "reps": a.reps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
