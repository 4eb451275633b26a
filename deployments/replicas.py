"""Drafter and Verifier deployments: thin wrappers over specdec's proposer and verifier.

Both hold per-sequence KV caches as soft state (rebuilt from the token list on a miss), so a
replica can be evicted, restarted or replaced without losing a request."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import ray
from ray import serve

from deployments.config import AppArgs
from specdec.protocol import Proposal

log = logging.getLogger("ray.serve")


def _engine_config(args: AppArgs):
    import torch

    from specdec.config import EngineConfig

    return EngineConfig(verifier=args.verifier, draft=args.draft, device=args.device, dtype=args.dtype,
                        max_seqs=args.max_seqs, max_model_len=args.max_model_len, progress=False)


class _Replica:
    """What both deployments share: one compute thread, a lock (Serve may call sync methods from
    several threads, and a runner's slot table is not thread-safe) and where the replica runs."""

    def __init__(self, num_threads: int = 0):
        self._lock = threading.Lock()
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

    async def _run(self, fn, *a):
        """Model compute off the event loop (health checks keep answering), one call at a time."""
        def locked():
            with self._lock:
                return fn(*a)

        return await asyncio.get_running_loop().run_in_executor(self._pool, locked)

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
        self.proposer = self._on_compute(build_proposer, self.args.draft, _engine_config(self.args))
        self.calls = 0
        self.busy_s = 0.0  # time spent proposing (prefetches included)
        # seq_id -> (request, proposal) drafted ahead by `prefetch`, waiting for the round's `propose`
        self._ready: OrderedDict[str, tuple] = OrderedDict()
        # ids freed lately: a prefetch that arrives after its sequence ended must not re-cache it
        self._freed: OrderedDict[str, None] = OrderedDict()
        self.prefetched = self.prefetch_hits = 0

    async def propose(self, requests):
        await self._touch_shard()
        self.calls += 1
        return await self._timed(self._propose, requests)

    async def prefetch(self, requests) -> None:
        """Draft a round ahead (sent by the Verifier right after its pass, with the new tokens and
        feature), so the ingress's `propose` for that round finds the drafts made while the
        verify result travelled to the ingress and the ingress called here."""
        await self._touch_shard()
        await self._timed(self._prefetch, requests)

    async def _timed(self, fn, requests):
        t0 = time.perf_counter()
        try:
            return await self._run(fn, requests)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _prefetch(self, requests) -> None:
        requests = [r for r in requests if r.seq_id not in self._freed]
        for r, p in zip(requests, self.proposer.propose(requests)):
            self._ready[r.seq_id] = (r, p)
            self._ready.move_to_end(r.seq_id)
        self.prefetched += len(requests)
        while len(self._ready) > 4 * self.args.max_seqs:  # never-claimed drafts of ended sequences
            self._ready.popitem(last=False)

    def _propose(self, requests):
        """Drafts from a prefetch where it drafted from the same tokens and settings and at least
        as far (a K-draft chain is the first K of a longer one: the same argmax or the same
        per-round generator draws), the rest computed now in one batch."""
        out, todo = [None] * len(requests), []
        for i, r in enumerate(requests):
            got = self._ready.pop(r.seq_id, None)
            k = r.num_speculative_tokens
            if got and got[0].tokens == r.tokens and got[0].params == r.params and got[0].num_speculative_tokens >= k:
                p = got[1]
                out[i] = Proposal(p.token_ids[:k], None if p.probs is None else p.probs[:k])
                self.prefetch_hits += 1
            else:
                todo.append(i)
        if todo:
            for i, p in zip(todo, self.proposer.propose([requests[i] for i in todo])):
                out[i] = p
        return out

    def free(self, seq_ids: list[str]) -> None:
        with self._lock:
            for s in seq_ids:
                self.proposer.free(s)
                self._ready.pop(s, None)
                self._freed[s] = None
            while len(self._freed) > 4096:
                self._freed.popitem(last=False)

    def stats(self) -> dict:
        runner = getattr(self.proposer, "runner", None)
        return {**self.where(), "calls": self.calls, "busy_s": self.busy_s, "proposer": self.proposer.name,
                "prefetched": self.prefetched, "prefetch_hits": self.prefetch_hits,
                "resident_sequences": sorted(runner.slots) if runner else []}


@serve.deployment(name="Verifier", max_ongoing_requests=16)
class Verifier(_Replica):
    def __init__(self, args: dict, drafter=None):
        from specdec.engine import build_verifier

        self.args = AppArgs(**args)
        super().__init__(self.args.num_threads)
        self.drafter = drafter  # for draft prefetch (None = off)
        self._prefetches: set[asyncio.Task] = set()
        self.verifier = self._on_compute(build_verifier, _engine_config(self.args))
        from specdec.models.layouts import describe, maybe_tune

        # on the compute thread, with its thread count: kernels are chosen per thread team
        decided = self._on_compute(maybe_tune, self.verifier.runner.model)
        # for operators: the kernel each weight shape uses by rows ('t' x @ W_t, 'w' F.linear, 'p' packed)
        self.layouts = describe(decided)

    async def verify(self, requests):
        await self._touch_shard()
        results = await self._run(self.verifier.verify, requests)
        if self.drafter is not None:
            self._prefetch(requests, results)
        return results

    def _prefetch(self, requests, results) -> None:
        """Ask the Drafter for the next round's drafts now, before the results go back: it drafts
        while they travel to the ingress and the ingress calls it, instead of after."""
        from specdec.protocol import ProposeRequest

        ahead = [ProposeRequest(r.seq_id, r.tokens + res.token_ids, r.prefetch_k, r.params, res.feature)
                 for r, res in zip(requests, results) if r.prefetch_k > 0]
        if not ahead:
            return
        call = self.drafter.options(multiplexed_model_id=serve.get_multiplexed_model_id()).prefetch.remote(ahead)

        async def wait():
            try:
                await call
            except Exception:  # a lost prefetch costs the round a fresh draft, nothing else
                log.warning("draft prefetch failed", exc_info=True)

        task = asyncio.get_running_loop().create_task(wait())
        self._prefetches.add(task)  # keep a reference until done
        task.add_done_callback(self._prefetches.discard)

    def free(self, seq_ids: list[str]) -> None:
        with self._lock:
            for s in seq_ids:
                self.verifier.free(s)

    def stats(self) -> dict:
        v = self.verifier
        return {**self.where(), "passes": v.passes, "batch_sizes": list(v.batch_sizes), "busy_s": v.busy_s,
                "resident_sequences": sorted(v.runner.slots), "evictions": v.runner.evictions, "layouts": self.layouts}

