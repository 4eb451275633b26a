"""What one remote call between Serve deployments costs, by value (gRPC) and by reference (object store).

A Caller deployment calls an Echo deployment that answers like a Verifier (routed by a
multiplexed shard id, as the round loop's calls are) but does no work, so every millisecond is
the call itself: routing, serialization, the transport, both replicas' event loops. Payloads
are a round's messages: one sequence's verify request (300 tokens and a feature), sixteen of
them, and sampled requests carrying their drafts' [K, V] probabilities (SmolLM2's V: 192 KB a
draft).
Transports alternate, twice. Bounded, local Ray, no HTTP.

    .venv/bin/python bench/calls.py [--calls 300]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deployments import ray_env  # noqa: E402

ray_env.apply()
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
import torch  # noqa: E402
from ray import serve  # noqa: E402

from specdec.protocol import VerifyRequest, VerifyResult  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402

DIM, VOCAB = 576, 49152  # SmolLM2-135M's hidden size and vocabulary


KINDS = {"1 seq": (1, 0), "16 seqs": (16, 0), "1 seq sampled K=4": (1, 4), "4 seqs sampled K=4": (4, 4)}


def payload(kind: str) -> list[VerifyRequest]:
    """A verify call's requests: (sequences, K of sampled drafts with their [K, V] q rows)."""
    n, k = KINDS[kind]
    return [VerifyRequest(f"seq-{i}", list(range(300)), list(range(k)), torch.rand(k, VOCAB) if k else None,
                          SamplingParams()) for i in range(n)]


@serve.deployment(max_ongoing_requests=16)
class Echo:
    @serve.multiplexed(max_num_models_per_replica=64)
    async def _shard(self, shard: str) -> str:
        return shard

    async def verify(self, requests):
        await self._shard(serve.get_multiplexed_model_id())
        return [VerifyResult([1, 2], 1, len(r.draft_token_ids), torch.zeros(DIM)) for r in requests]


@serve.deployment(max_ongoing_requests=4)
class Caller:
    def __init__(self, echo):
        self.echo = echo

    async def time_calls(self, transport: str, kind: str, calls: int) -> list[float]:
        h = self.echo.options(_by_reference=transport == "actor", multiplexed_model_id="shard-0")
        reqs, out = payload(kind), []
        for _ in range(calls + 10):  # the first ten warm the connection up
            t0 = time.perf_counter()
            await h.verify.remote(reqs)
            out.append(time.perf_counter() - t0)
        return out[10:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300, help="timed calls per transport, payload and round")
    ap.add_argument("--out", default=str(ROOT / "bench/results/calls.json"))
    a = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    quiet = {"enable_access_log": False, "log_level": "WARNING"}
    caller = serve.run(Caller.options(logging_config=quiet).bind(Echo.options(logging_config=quiet).bind()),
                       name="calls", route_prefix=None)
    kinds, transports = list(KINDS), ["actor", "grpc"]
    samples = {(t, k): [] for t in transports for k in kinds}
    try:
        for _ in range(2):
            for k in kinds:
                for t in transports:
                    samples[t, k] += caller.time_calls.remote(t, k, a.calls).result()
    finally:
        serve.shutdown()
        ray.shutdown()
    rows = []
    print("| payload | transport | median ms | p90 ms |\n|---|---|---|---|")
    for k in kinds:
        for t in transports:
            s = samples[t, k]
            row = {"payload": k, "transport": t, "calls": len(s), "median_ms": round(statistics.median(s) * 1e3, 2),
                   "p90_ms": round(statistics.quantiles(s, n=10)[-1] * 1e3, 2)}
            rows.append(row)
            print(f"| {k} | {t} | {row['median_ms']} | {row['p90_ms']} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "ray": ray.__version__,
                                       "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "rows": rows},
                                      indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
