"""Load test of the Serve app (127.0.0.1 only, bounded): 1, 4 and 16 concurrent users, speculation
on and off, plus the in-process engine at one user for comparison.

    .venv/bin/python bench/serve_load.py [--tiny] [--users 1 4 16] [--reps 3] [--one-user-reps 8] [--max-tokens 64]

Each level runs --reps times (1 user: --one-user-reps) with speculation on and off alternating
first, so drift favours neither; the in-process engine answers the same question between the
1-user reps, and Serve vs in-process is the median of those paired ratios. Reports the median
aggregate tok/s, p50/p99 latency, TTFT and the verifier's mean batch size, and writes
bench/results/serve_load[-tiny].json."""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics as st
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from specdec.bench import machine  # noqa: E402

QUESTIONS = ["Explain how vaccines train the immune system.", "Write a Python function that merges two sorted lists.",
             "List five tips for better sleep.", "Tell a short story about a lighthouse keeper.",
             "What is the difference between TCP and UDP?", "Give three uses of a binary search tree.",
             "Summarize the plot of a heist movie in four sentences.", "How does a bicycle stay upright?"]


_asked = itertools.count()


def ask(i: int) -> str:
    """Question i, tagged so that no two requests of the run are the same: the replicas' prefix
    cache then reuses what real traffic shares (the chat template's system prompt), never a
    whole repeated prompt."""
    return f"(#{next(_asked)}) {QUESTIONS[i % len(QUESTIONS)]}"


async def one_request(client, url, model, i, max_tokens, spec: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": ask(i)}],
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


def tokens_for(i: int, max_tokens) -> int:
    """max_tokens, or with (lo, hi) a length drawn for request i: the same for speculation and
    K=0 in a rep pair, which ask the same request numbers."""
    return max_tokens if isinstance(max_tokens, int) else random.Random(i).randint(*max_tokens)


async def run_level(url, model, users, requests, max_tokens, spec, offset=0) -> dict:
    import httpx

    async with httpx.AsyncClient() as client:
        async def user(u):
            ids = [offset + u * requests + j for j in range(requests)]
            return [await one_request(client, url, model, i, tokens_for(i, max_tokens), spec) for i in ids]

        t0 = time.perf_counter()
        per_user = await asyncio.gather(*(user(u) for u in range(users)))
        wall = time.perf_counter() - t0
    rs = [r for rr in per_user for r in rr]
    return {"tokens_per_s": sum(r["tokens"] for r in rs) / wall, "requests": rs}


def merge(users: int, spec: bool, reps: list[dict]) -> dict:
    """One table row from repeated runs: the median rep's throughput, latencies over all requests."""
    rs = [r for rep in reps for r in rep["requests"]]
    lat = sorted(r["latency_s"] for r in rs)
    tps = [rep["tokens_per_s"] for rep in reps]
    return {"users": users, "speculation": spec, "requests": len(rs), "tokens": sum(r["tokens"] for r in rs),
            "aggregate_tokens_per_s": st.median(tps), "aggregate_tokens_per_s_reps": tps,
            "p50_latency_s": st.median(lat), "p99_latency_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "mean_ttft_s": st.mean(r["ttft_s"] for r in rs if r["ttft_s"] is not None),
            "acceptance_rate": st.mean(r["acceptance_rate"] for r in rs)}


def paired_ratio(pairs: list[float], resamples: int = 10000) -> dict:
    """Back-to-back pairs' ratios: their median and range, and their geometric mean with a 95 %
    bootstrap interval (seeded), so a tie can be told from a loss of a given size: a level's
    throughput drifts a few percent between reps, and one run's median can fall either side of 1."""
    import math
    import random

    logs = [math.log(x) for x in pairs]
    rng = random.Random(0)
    means = sorted(st.mean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    ci = [math.exp(means[int(0.025 * resamples)]), math.exp(means[int(0.975 * resamples) - 1])]
    return {"median": st.median(pairs), "min": min(pairs), "max": max(pairs),
            "geomean": math.exp(st.mean(logs)), "geomean_ci95": ci, "reps": pairs}


def app_overrides(sets: list[str], tiny: bool = False) -> dict:
    """The app args a load run changes from serve_config.yaml: no API keys, room for 16 users,
    random models with `tiny`, then each --set ARG=VALUE (VALUE parsed as YAML)."""
    override = {"api_keys_env": None, "max_batch_size": 16, "max_queue": 128}
    if tiny:
        override.update(verifier="tiny", draft="tiny:noise=0.05", model_name="tiny")
    for kv in sets:
        key, _, value = kv.partition("=")
        override[key] = yaml.safe_load(value)
    return override


def round_summary(rounds: list[dict]) -> dict:
    """What the ingress's rounds did (its loop_stats trace): how often they drafted, and what a
    drafting and a plain round cost as the ingress saw them."""
    spec = [r for r in rounds if any(r["drafted"])]
    plain = [r for r in rounds if not any(r["drafted"])]
    ms = lambda xs: 1000 * st.mean(xs) if xs else None  # noqa: E731
    return {"rounds": len(rounds), "drafting_rounds": len(spec),
            "tokens_per_drafting_round": st.mean(sum(r["emitted"]) / len(r["emitted"]) for r in spec) if spec else None,
            "drafting_round_verify_ms": ms([r["verify_s"] for r in spec]),
            "drafting_round_draft_wait_ms": ms([r["draft_s"] for r in spec]),
            "plain_round_ms_per_step": ms([r["verify_s"] / r["steps"] for r in plain]),
            "plain_round_pass_ms_per_step": ms([r["passes_s"] / r["steps"] for r in plain]),
            # who drafted: prompt lookup (free, no Drafter call) or the draft model, and how much
            "lookup_drafted": sum(d for r in spec for d, lk in zip(r["drafted"], r["lookup"]) if lk),
            "model_drafted": sum(d for r in spec for d, lk in zip(r["drafted"], r["lookup"]) if not lk),
            "accepted": sum(sum(r["accepted"]) for r in spec),
            "sequences_drafting_per_drafting_round": st.mean(sum(d > 0 for d in r["drafted"]) for r in spec) if spec else None}


def in_process_engine(args_override):
    """The engine the app's replicas run (serve_config.yaml's args and the overrides), in this process."""
    import torch

    from deployments.config import AppArgs
    from specdec.engine import SpecEngine

    torch.set_num_threads(2)
    args = AppArgs.from_yaml(ROOT / "serve_config.yaml").model_dump() | args_override
    return SpecEngine.from_config(AppArgs(**args).engine().model_copy(update={"max_seqs": 4}))


def in_process_tps(eng, i: int, max_tokens: int) -> float:
    from specdec.sampling import SamplingParams

    msgs = [{"role": "user", "content": ask(i)}]
    c = eng.generate([msgs], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    return len(c.token_ids) / c.metrics.latency_s


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tiny", action="store_true", help="tiny random models instead of the default pair")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--reps", type=int, default=3, help="repetitions per level; speculation on/off alternate")
    ap.add_argument("--one-user-reps", type=int, default=8,
                    help="repetitions at 1 user (cheap; each rep is one question, paired with the in-process engine)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-user", type=int, default=1,
                    help="at 4 and 16 users, requests each user sends back to back in a rep (1: the users' requests "
                         "start together and the rep ends with the last; more: a user whose request ended sends "
                         "its next at once, so the batch stays full as in steady traffic)")
    ap.add_argument("--vary-tokens", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="at 4 and 16 users, each request's max_tokens drawn from LO..HI (the same for "
                         "speculation and K=0): answers of one length keep plain decoding's batch in "
                         "lockstep, which real traffic does not")
    ap.add_argument("--warmup-reps", type=int, default=1,
                    help="unrecorded K=0 reps at each level's concurrency before its measured ones: the first "
                         "passes at a new batch shape pay one-time costs (oneDNN kernels made for the shape, cache "
                         "pages first touched) that would fall on rep 0's first variant, always speculation")
    ap.add_argument("--control", action="store_true",
                    help="an A/A control: the 'speculation' arm runs K=0 too, so its ratios show what the harness "
                         "itself measures between two identical arms (order, drift, noise)")
    ap.add_argument("--set", action="append", default=[], metavar="ARG=VALUE",
                    help="override an app arg of serve_config.yaml (VALUE parsed as YAML), e.g. --set draft_num_threads=2")
    ap.add_argument("--name", default=None, help="results file bench/results/<name>.json (default serve_load[-tiny])")
    return ap.parse_args()


def measure_level(a, url, model, users, verifier, ingress, eng, engine_runs: list[float]) -> list[dict]:
    """A level's reps, speculation on and off alternating first: its two table rows. At 1 user the
    in-process engine answers each rep's question too (engine_runs)."""
    reps = {True: [], False: []}
    sizes = {True: [], False: []}
    traces = {True: [], False: []}
    per_user = 1 if users == 1 else a.requests_per_user
    lengths = tuple(a.vary_tokens) if a.vary_tokens and users > 1 else a.max_tokens
    for w in range(a.warmup_reps if users > 1 else 0):  # 1 user: the run's own warm-up did it
        asyncio.run(run_level(url, model, users, per_user, lengths, False, offset=w * users * per_user))
    for rep in range(a.one_user_reps if users == 1 else a.reps):  # alternate the order so drift favours neither
        for spec in ((True, False) if rep % 2 == 0 else (False, True)):
            passes_before = verifier.stats.remote().result()["passes"]
            rounds_before = ingress.loop_stats.remote().result()["rounds"]
            reps[spec].append(asyncio.run(run_level(url, model, users, per_user, lengths, spec and not a.control,
                                                    offset=rep * users * per_user)))
            vs = verifier.stats.remote().result()
            # this rep's passes (the replica keeps the last few thousand: a long rep's tail)
            sizes[spec] += vs["batch_sizes"][-(vs["passes"] - passes_before):] if vs["passes"] > passes_before else []
            ls = ingress.loop_stats.remote().result()
            new = ls["rounds"] - rounds_before  # this rep's rounds (at most the trace's length)
            traces[spec] += ls["recent_rounds"][-new:] if new else []
        if users == 1:
            engine_runs.append(in_process_tps(eng, rep, a.max_tokens))
    # what adaptive K had learned by the end of the level (costs per batch size, acceptance
    # per position): why a level drafted as much as it did
    learned = ingress.loop_stats.remote().result().get("adaptive")
    rows = []
    for spec in (True, False):
        row = merge(users, spec, reps[spec])
        row["verifier_mean_batch_size"] = st.mean(sizes[spec]) if sizes[spec] else 0.0
        row["rounds"] = round_summary(traces[spec])
        if spec:
            row["adaptive_state_after"] = learned
            row["drafting_rounds_sample"] = [r for r in traces[spec] if any(r["drafted"])][:24]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def summarize(rows: list[dict], engine_runs: list[float], engine_tps: float, users: list[int]) -> dict:
    """The run's ratios: Serve against in-process at 1 user, 16 users against 1, speculation
    against K=0 per level."""
    by = {(r["users"], r["speculation"]): r for r in rows}
    one = by.get((1, True), {}).get("aggregate_tokens_per_s")
    # 1-user rep i asks question i of both paths: acceptance, and so speed, depends on the question
    # far more than on the path, so the ratio is taken per question and then its median
    paired = [s / e for s, e in zip(by[(1, True)]["aggregate_tokens_per_s_reps"], engine_runs)] if one and engine_runs else []
    summary = {"in_process_engine_tokens_per_s_1_user": engine_tps,
               "serve_vs_in_process_1_user": st.median(paired) if paired else None,
               "serve_vs_in_process_1_user_per_question": paired,
               "serve_vs_in_process_1_user_paired": paired_ratio(paired) if paired else None,
               "serve_vs_in_process_1_user_of_medians": one / engine_tps if one else None}
    if (16, True) in by and one:
        summary["aggregate_16_vs_1_user"] = by[(16, True)]["aggregate_tokens_per_s"] / one
        summary["spec_vs_k0_at_16_users"] = by[(16, True)]["aggregate_tokens_per_s"] / by[(16, False)]["aggregate_tokens_per_s"]
    for u in users:
        if (u, True) in by and (u, False) in by:
            on, off = by[(u, True)], by[(u, False)]
            summary[f"spec_vs_k0_at_{u}_users"] = on["aggregate_tokens_per_s"] / off["aggregate_tokens_per_s"]
            # rep i's two runs are back to back: their ratio cancels the box's drift, which moves a
            # level's throughput by a few percent between reps (as much as a tie's medians differ)
            pairs = [x / y for x, y in zip(on["aggregate_tokens_per_s_reps"], off["aggregate_tokens_per_s_reps"])]
            summary[f"spec_vs_k0_at_{u}_users_paired"] = paired_ratio(pairs)
    return summary


def table(rows: list[dict]) -> list[str]:
    lines = ["| users | speculation | agg tok/s | p50 s | p99 s | TTFT s | mean verifier batch | acceptance |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['users']} | {'on' if r['speculation'] else 'off (K=0)'} | {r['aggregate_tokens_per_s']:.1f} | "
                     f"{r['p50_latency_s']:.2f} | {r['p99_latency_s']:.2f} | {r['mean_ttft_s']:.3f} | "
                     f"{r['verifier_mean_batch_size']:.2f} | {r['acceptance_rate']:.2f} |")
    return lines


def main() -> int:
    a = parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray import serve

    from serve_helpers import run_app, serve_cluster

    override = app_overrides(a.set, a.tiny)
    model = override.get("model_name", "SmolLM2-135M-Instruct")
    rows, engine_runs = [], []
    eng = in_process_engine(override)  # the in-process engine, run between the 1-user Serve reps
    in_process_tps(eng, 0, 16)  # warm-up
    with serve_cluster() as url:
        verifier, _ = run_app("specdec", "/", override)
        ingress = serve.get_deployment_handle("OpenAIIngress", "specdec")
        asyncio.run(run_level(url, model, 1, 1, 16, True))  # warm-up
        for users in a.users:
            rows += measure_level(a, url, model, users, verifier, ingress, eng, engine_runs)
        vstats = verifier.stats.remote().result()
        prefix_cache = {k: vstats.get(k) for k in ("prefix_hits", "prefix_tokens_reused")}
        serve.delete("specdec")
    engine_tps = st.median(engine_runs) if engine_runs else in_process_tps(eng, 0, a.max_tokens)
    summary = summarize(rows, engine_runs, engine_tps, a.users) | {"verifier_prefix_cache": prefix_cache}
    lines = table(rows)
    print("\n".join(lines))
    print(json.dumps(summary, indent=1))
    out = ROOT / "bench" / "results" / f"{a.name or 'serve_load' + ('-tiny' if a.tiny else '')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "summary": summary, "table": lines,
                               "config": {"machine": machine(), "overrides": a.set, "max_tokens": a.max_tokens, "reps": a.reps, "one_user_reps": a.one_user_reps,
                                          "requests_per_user": a.requests_per_user, "vary_tokens": a.vary_tokens,
                                          "warmup_reps": a.warmup_reps, "control": a.control,
                                          "in_process_tokens_per_s_reps": engine_runs}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
