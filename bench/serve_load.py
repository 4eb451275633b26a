"""Load test of the Serve app (127.0.0.1 only, bounded): 1, 4 and 16 concurrent users, speculation
on and off, plus the in-process engine at one user for comparison.

    .venv/bin/python bench/serve_load.py [--tiny] [--users 1 4 16] [--requests 2] [--max-tokens 64]

Reports aggregate tok/s, p50/p99 latency, TTFT and the verifier's mean batch size, and writes
bench/results/serve_load[-tiny].json."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics as st
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

QUESTIONS = ["Explain how vaccines train the immune system.", "Write a Python function that merges two sorted lists.",
             "List five tips for better sleep.", "Tell a short story about a lighthouse keeper.",
             "What is the difference between TCP and UDP?", "Give three uses of a binary search tree.",
             "Summarize the plot of a heist movie in four sentences.", "How does a bicycle stay upright?"]


async def one_request(client, url, model, i, max_tokens, spec: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    if not spec:
        body["proposer"] = "none"
    t0 = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("choices") and obj["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.perf_counter() - t0
            if obj.get("usage"):
                usage = obj["usage"]
    return {"latency_s": time.perf_counter() - t0, "ttft_s": ttft, "tokens": usage["completion_tokens"],
            "acceptance_rate": usage["speculative"]["acceptance_rate"]}


async def run_level(url, model, users, requests, max_tokens, spec) -> dict:
    import httpx

    async with httpx.AsyncClient() as client:
        async def user(u):
            return [await one_request(client, url, model, u * requests + j, max_tokens, spec) for j in range(requests)]

        t0 = time.perf_counter()
        per_user = await asyncio.gather(*(user(u) for u in range(users)))
        wall = time.perf_counter() - t0
    rs = [r for rr in per_user for r in rr]
    lat = sorted(r["latency_s"] for r in rs)
    return {"users": users, "speculation": spec, "requests": len(rs), "tokens": sum(r["tokens"] for r in rs),
            "aggregate_tokens_per_s": sum(r["tokens"] for r in rs) / wall, "p50_latency_s": st.median(lat),
            "p99_latency_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "mean_ttft_s": st.mean(r["ttft_s"] for r in rs if r["ttft_s"] is not None),
            "acceptance_rate": st.mean(r["acceptance_rate"] for r in rs)}


def in_process_tps(args_override, max_tokens, n=2) -> float:
    from specdec.config import EngineConfig
    from specdec.engine import SpecEngine
    from specdec.sampling import SamplingParams

    eng = SpecEngine.from_config(EngineConfig(verifier=args_override.get("verifier", "default"),
                                              draft=args_override.get("draft", "default"), adaptive=True,
                                              num_speculative_tokens=8, max_seqs=4, progress=False))
    tok = total = 0.0
    for i in range(n + 1):
        msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        c = eng.generate([msgs], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
        if i:  # the first is warm-up
            tok += len(c.token_ids)
            total += c.metrics.latency_s
    return tok / total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tiny", action="store_true", help="tiny random models instead of the default pair")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=2, help="requests per user, sent one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray import serve

    from serve_helpers import run_app, serve_cluster

    override = {"api_keys_env": None, "max_batch_size": 16, "max_queue": 128}
    if a.tiny:
        override.update(verifier="tiny", draft="tiny:noise=0.05", model_name="tiny")
    model = override.get("model_name", "SmolLM2-135M-Instruct")
    rows = []
    with serve_cluster() as url:
        verifier, _ = run_app("specdec", "/", override)
        asyncio.run(run_level(url, model, 1, 1, 16, True))  # warm-up
        for users in a.users:
            for spec in (True, False):
                before = verifier.stats.remote().result()["batch_sizes"]
                row = asyncio.run(run_level(url, model, users, a.requests, a.max_tokens, spec))
                sizes = verifier.stats.remote().result()["batch_sizes"][len(before):]
                row["verifier_mean_batch_size"] = st.mean(sizes) if sizes else 0.0
                rows.append(row)
                print(json.dumps(row), flush=True)
        serve.delete("specdec")
    engine_tps = in_process_tps(override, a.max_tokens)
    by = {(r["users"], r["speculation"]): r for r in rows}
    one = by.get((1, True), {}).get("aggregate_tokens_per_s")
    summary = {"in_process_engine_tokens_per_s_1_user": engine_tps,
               "serve_vs_in_process_1_user": one / engine_tps if one else None}
    if (16, True) in by and one:
        summary["aggregate_16_vs_1_user"] = by[(16, True)]["aggregate_tokens_per_s"] / one
        summary["spec_vs_k0_at_16_users"] = by[(16, True)]["aggregate_tokens_per_s"] / by[(16, False)]["aggregate_tokens_per_s"]
    for u in a.users:
        if (u, True) in by and (u, False) in by:
            summary[f"spec_vs_k0_at_{u}_users"] = by[(u, True)]["aggregate_tokens_per_s"] / by[(u, False)]["aggregate_tokens_per_s"]
    head = "| users | speculation | agg tok/s | p50 s | p99 s | TTFT s | mean verifier batch | acceptance |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['users']} | {'on' if r['speculation'] else 'off (K=0)'} | {r['aggregate_tokens_per_s']:.1f} | "
                     f"{r['p50_latency_s']:.2f} | {r['p99_latency_s']:.2f} | {r['mean_ttft_s']:.3f} | "
                     f"{r['verifier_mean_batch_size']:.2f} | {r['acceptance_rate']:.2f} |")
    print("\n".join(lines))
    print(json.dumps(summary, indent=1))
    out = ROOT / "bench" / "results" / f"serve_load{'-tiny' if a.tiny else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "summary": summary, "table": lines,
                               "config": {"max_tokens": a.max_tokens, "requests_per_user": a.requests}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
