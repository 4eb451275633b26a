"""Drafter and Verifier deployments: thin wrappers over specdec's proposer and verifier.

Both hold per-sequence KV caches as soft state (rebuilt from the token list on a miss), so a
replica can be evicted, restarted or replaced without losing a request."""
from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import ray
from ray import serve

from deployments.config import AppArgs
from specdec.protocol import Proposal


class _Replica:
    """What both deployments share: one compute thread, a lock (Serve may call sync methods from
    several threads, and a runner's slot table is not thread-safe) and where the replica runs."""

    def __init__(self, num_threads: int = 0):
        self._lock = threading.Lock()
        # ids freed lately: a draft call that arrives after its sequence ended must not re-cache it
        self._freed: OrderedDict[str, None] = OrderedDict()
        # Every model call runs on this one thread. OpenMP keeps a thread team per calling
        # thread, and Ray starts a num_cpus=0 actor with OMP_NUM_THREADS=1: a pool of changing
        # threads (asyncio.to_thread) makes new teams with the wrong size. Measured on the
        # default verifier, 2 threads: 45-54 ms/token on one fixed thread, 59-62 ms via to_thread.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="compute")
        if num_threads:
            import torch

            self._pool.submit(torch.set_num_threads, num_threads).result()

    def _on_compute(self, fn, *a):
        """Run fn on the compute thread and wait: model building and tuning go there too.
        libgomp keeps a thread team per calling thread, and once a process holds more OpenMP
        threads than CPUs every team spins only ~100 iterations before sleeping in a futex:
        building the verifier on the actor's main thread left a second team behind and cost
        the default verifier's 1-token pass 55 -> 60-90 ms (1.3 instead of 2.0 CPU-s per s)."""
        return self._pool.submit(fn, *a).result()

    def where(self) -> dict:
        ctx = serve.get_replica_context()
        # cpu_s against busy_s: how many cores the model calls keep busy (2 threads should give ~2)
        return {"node_id": ray.get_runtime_context().get_node_id(), "replica": ctx.replica_tag, "pid": os.getpid(),
                "cpu_s": time.process_time()}

    @serve.multiplexed(max_num_models_per_replica=64)
    async def _shard(self, shard: str) -> str:
        # sequences are grouped into shards routed as multiplexed "models": Serve sends a shard
        # back to the replica that served it before, which is where its caches are
        return shard

    def _locked(self, fn, *a):
        with self._lock:
            return fn(*a)

    async def _run(self, fn, *a):
        """Model compute off the event loop (health checks keep answering), one call at a time."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._locked, fn, *a)

    def _forget(self, seq_id: str) -> None:
        self._freed[seq_id] = None
        while len(self._freed) > 4096:
            self._freed.popitem(last=False)

    async def _touch_shard(self) -> None:
        shard = serve.get_multiplexed_model_id()
        if shard:
            await self._shard(shard)


@serve.deployment(name="Drafter", max_ongoing_requests=16)
class Drafter(_Replica):
    def __init__(self, args: dict):
        from specdec.engine import build_proposer

        self.args = AppArgs(**args)
        super().__init__(self.args.draft_num_threads)
        self.proposer = self._on_compute(build_proposer, self.args.draft, self.args.engine())
        self.calls = 0
        self.in_flight = 0  # propose calls started and not yet answered (a fault test kills it mid-call)
        self.busy_s = 0.0  # time spent proposing

    async def propose(self, requests) -> list[Proposal]:
        await self._touch_shard()
        self.calls += 1
        self.in_flight += 1
        t0 = time.perf_counter()
        try:
            return await self._run(self._propose, requests)
        finally:
            self.in_flight -= 1
            self.busy_s += time.perf_counter() - t0

    def _propose(self, requests) -> list[Proposal]:
        live = [i for i, r in enumerate(requests) if r.seq_id not in self._freed]
        out = [Proposal([], None) for _ in requests]
        for i, p in zip(live, self.proposer.propose([requests[i] for i in live]) if live else []):
            out[i] = p
        return out

    def free(self, seq_ids: list[str]) -> None:
        with self._lock:
            for s in seq_ids:
                self.proposer.free(s)
                self._forget(s)

    def stats(self) -> dict:
        runner = getattr(self.proposer, "runner", None)
        return {**self.where(), "calls": self.calls, "in_flight": self.in_flight, "busy_s": self.busy_s,
                "proposer": self.proposer.name,
                "resident_sequences": sorted(runner.slots) if runner else []}


@serve.deployment(name="Verifier", max_ongoing_requests=16)
class Verifier(_Replica):
    def __init__(self, args: dict):
        from specdec.engine import build_proposer, build_verifier

        self.args = AppArgs(**args)
        super().__init__(self.args.num_threads)
        self.verifier = self._on_compute(build_verifier, self.args.engine())
        if self.args.draft_in_verifier:  # the draft head drafts here, next to the features it reads
            self.verifier.drafter = self._on_compute(build_proposer, self.args.draft, self.args.engine(),
                                                     self.verifier.runner.model)
        from specdec.models.layouts import describe, maybe_tune

        # on the compute thread, with its thread count: kernels are chosen per thread team
        decided = self._on_compute(maybe_tune, self.verifier.runner.model) if self.args.tune_layouts else {}
        # for operators: the kernel each weight shape uses by rows ('t' x @ W_t, 'w' F.linear, 'p' packed)
        self.layouts = describe(decided)

    async def verify(self, requests):
        await self._touch_shard()
        return await self._run(self.verifier.verify, requests)

    async def prompt_logprobs(self, seq_id: str, tokens: list[int], n: int):
        await self._touch_shard()
        return await self._run(self.verifier.prompt_logprobs, seq_id, tokens, n)

    def free(self, seq_ids: list[str]) -> None:
        with self._lock:
            for s in seq_ids:
                self.verifier.free(s)

    def cache_stats(self) -> dict:
        """The KV-cache figures /metrics exports (cheap: a scrape asks every few seconds)."""
        r = self.verifier.runner
        return {"replica": serve.get_replica_context().replica_tag, "resident": len(r.slots), "max_seqs": r.max_seqs,
                "prefix_tokens_reused": r.prefix_tokens_reused}

    def stats(self) -> dict:
        v = self.verifier
        return {**self.where(), "passes": v.passes, "batch_sizes": list(v.batch_sizes), "busy_s": v.busy_s,
                "resident_sequences": sorted(v.runner.slots), "evictions": v.runner.evictions, "layouts": self.layouts,
                "prefix_hits": v.runner.prefix_hits, "prefix_tokens_reused": v.runner.prefix_tokens_reused,
                "draft_failures": v.draft_failures}
