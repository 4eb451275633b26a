"""Every round the ingress ran, per load level and rep, speculation on and off (127.0.0.1 only,
bounded): what adaptive K chose in each round, with what it had learned by the end of the rep.
For finding where a serve_load run lost time; serve_load itself keeps only a summary.

    .venv/bin/python bench/round_traces.py [--levels 1:4 4:3 16:4] [--set ARG=VALUE] [--out FILE]

--levels USERS:REPS runs in order on one app (as serve_load does), speculation on and off
alternating first. Writes a JSON list, one entry per (level, rep, variant): tok/s, each request's
(start, end) and the rounds (`OpenAIIngress.loop_stats()["recent_rounds"]`: start time, batch
size, prefill, K per sequence, drafted / accepted / emitted, decode steps, verify and draft
seconds), and prints one line per entry and a round-by-round view of the drafting rounds."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import serve_load  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--levels", nargs="+", default=["1:4", "4:3", "16:4"], help="USERS:REPS, run in order")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--set", action="append", default=[], metavar="ARG=VALUE", help="override an app arg (YAML value)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "round_traces.json"))
    a = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray import serve

    from serve_helpers import run_app, serve_cluster

    override = serve_load.app_overrides(a.set)
    model = override.get("model_name", "SmolLM2-135M-Instruct")
    out = []
    with serve_cluster() as url:
        run_app("specdec", "/", override)
        ingress = serve.get_deployment_handle("OpenAIIngress", "specdec")
        asyncio.run(serve_load.run_level(url, model, 1, 1, 16, True))  # warm-up
        for level in a.levels:
            users, reps = map(int, level.split(":"))
            if users > 1:  # as serve_load does: an unrecorded K=0 rep at the level's concurrency first
                asyncio.run(serve_load.run_level(url, model, users, 1, a.max_tokens, False))
            for rep in range(reps):
                for spec in ((True, False) if rep % 2 == 0 else (False, True)):
                    before = ingress.loop_stats.remote().result()["rounds"]
                    res = asyncio.run(serve_load.run_level(url, model, users, 1, a.max_tokens, spec, offset=rep * users))
                    stats = ingress.loop_stats.remote().result()
                    new = stats["rounds"] - before
                    rounds = stats["recent_rounds"][-new:] if new else []
                    out.append({"users": users, "rep": rep, "speculation": spec, "tokens_per_s": res["tokens_per_s"],
                                "requests": res["requests"], "rounds": rounds, "adaptive_state_after": stats["adaptive"]})
                    drafting = [r for r in rounds if any(r["drafted"])]
                    print(f"{users:>2} users rep {rep} {'spec' if spec else 'k0  '} {res['tokens_per_s']:6.1f} tok/s, "
                          f"{len(rounds)} rounds, {len(drafting)} drafting", flush=True)
                    for r in drafting:
                        print(f"    B={r['batch']} prefill={int(r['prefill'])} K={''.join(str(min(k, 9)) for k in r['ks'])} "
                              f"emitted={sum(r['emitted'])} verify={1000 * r['verify_s']:.0f} ms draft={1000 * r['draft_s']:.0f} ms")
        serve.delete("specdec")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out))
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
