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
from deployments.transport import Transport
from specdec.protocol import Proposal

log = logging.getLogger("ray.serve")


def _engine_config(args: AppArgs):
    import torch

    from specdec.config import EngineConfig

    return EngineConfig(verifier=args.verifier, draft=args.draft, device=args.device, dtype=args.dtype,
                        max_seqs=args.max_seqs, max_model_len=args.max_model_len, prefix_caching=args.prefix_caching,
                        progress=False)


class _Replica:
    """What both deployments share: one compute thread, a lock (Serve may call sync methods from
    several threads, and a runner's slot table is not thread-safe) and where the replica runs."""

    def __init__(self, num_threads: int = 0, nice: int = 0):
        self._lock = threading.Lock()
        # ids freed lately: a draft call that arrives after its sequence ended must not re-cache it
        self._freed: OrderedDict[str, None] = OrderedDict()
        # Every model call runs on this one thread. OpenMP keeps a thread team per calling
        # thread, and Ray starts a num_cpus=0 actor with OMP_NUM_THREADS=1: a pool of changing
        # threads (asyncio.to_thread) makes new teams with the wrong size. Measured on the
        # default verifier, 2 threads: 45-54 ms/token on one fixed thread, 59-62 ms via to_thread.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="compute")
        if nice:
            # Linux nice is per thread; the compute thread's OpenMP workers, created after this,
            # inherit it (raising niceness needs no privileges)
            self._pool.submit(os.nice, nice).result()
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
        super().__init__(self.args.draft_num_threads, self.args.draft_nice)
        self.proposer = self._on_compute(build_proposer, self.args.draft, _engine_config(self.args))
        self.calls = 0
        self.busy_s = 0.0  # time spent proposing

    async def propose(self, requests) -> list[Proposal]:
        await self._touch_shard()
        self.calls += 1
        t0 = time.perf_counter()
        try:
            return await self._run(self._propose, requests)
        finally:
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
        return {**self.where(), "calls": self.calls, "busy_s": self.busy_s, "proposer": self.proposer.name,
                "resident_sequences": sorted(runner.slots) if runner else []}


@serve.deployment(name="Verifier", max_ongoing_requests=16)
class Verifier(_Replica):
    """With a drafter handle (draft prefetch on), a request may leave its drafts to the Verifier
    (fetch_k): right after each pass it asks the Drafter for the next round's drafts, which are
    made while the results travel to the driver and its next call travels back, and that call
    takes them. A speculative round is then one remote call for the driver instead of two, and
    the draft probabilities go drafter -> verifier directly."""

    def __init__(self, args: dict, drafter=None):
        from specdec.engine import build_verifier

        self.args = AppArgs(**args)
        super().__init__(self.args.num_threads)
        self.drafter = Transport(drafter, self.args.transport)
        # seq_id -> (the ProposeRequest drafted ahead, index in its call, task with the call's proposals)
        self._ahead: OrderedDict[str, tuple] = OrderedDict()
        self.prefetched = self.prefetch_hits = self.draft_failures = 0
        self._no_ahead: set[str] = set()  # sequences a waiting call drafts for: decoding ahead stops for them
        self.verifier = self._on_compute(build_verifier, _engine_config(self.args))
        from specdec.models.layouts import describe, maybe_tune

        # on the compute thread, with its thread count: kernels are chosen per thread team
        decided = self._on_compute(maybe_tune, self.verifier.runner.model)
        # for operators: the kernel each weight shape uses by rows ('t' x @ W_t, 'w' F.linear, 'p' packed)
        self.layouts = describe(decided)

    async def verify(self, requests):
        await self._touch_shard()
        # decoding ahead for a sequence this call drafts for is wasted: stop it after its current step
        self._no_ahead.update(r.seq_id for r in requests if r.fetch_k or r.draft_token_ids)
        draft_s, failed = 0.0, False
        if any(r.fetch_k for r in requests) and self.drafter:
            t0 = time.perf_counter()
            failed = not await self._fetch_drafts(requests)
            draft_s = time.perf_counter() - t0
        for r in requests:
            if not r.fetch_k:  # drafted ahead but not wanted (K went to 0): drop
                self._ahead.pop(r.seq_id, None)
        results = await self._run(self._verify, requests)
        if self.drafter:
            self._prefetch(requests, results)
        if any(r.ahead_steps for r in requests):
            # queued on the compute thread now, so it runs while the results travel back; the
            # next call queues behind it and finds its tokens done
            job = self._pool.submit(self._locked, self.verifier.decode_ahead, requests, results, self._keep_ahead)
            job.add_done_callback(lambda f: f.exception() and log.error("decoding ahead failed", exc_info=f.exception()))
        for res in results:
            res.draft_s, res.draft_failed = draft_s, failed
        return results

    async def prompt_logprobs(self, seq_id: str, tokens: list[int], n: int):
        await self._touch_shard()
        return await self._run(self.verifier.prompt_logprobs, seq_id, tokens, n)

    def _verify(self, requests):
        self._no_ahead.difference_update(r.seq_id for r in requests)  # this call's own wishes are served now
        return self.verifier.verify(requests)

    def _keep_ahead(self, seq_id: str) -> bool:
        return seq_id not in self._no_ahead and seq_id not in self._freed

    def _draft(self, reqs) -> asyncio.Task:
        """One Drafter call, as a task several sequences' waits can share."""
        handle = self.drafter.for_proposals(reqs)
        call = handle.options(multiplexed_model_id=serve.get_multiplexed_model_id()).propose.remote(reqs)

        async def answer():
            props = await asyncio.wait_for(call, self.args.drafter_timeout_s)
            self.drafter.learn(props)
            return props

        return asyncio.get_running_loop().create_task(answer())

    async def _fetch_drafts(self, requests) -> bool:
        """Fill each fetch_k request's drafts: from the prefetch that drafted from the same tokens
        and settings and at least as far (K drafts are the first K of a longer chain: the same
        argmax, or the same per-round generator draws), the rest in one call now. False when the
        drafter failed (those requests are verified without drafts)."""
        from specdec.protocol import ProposeRequest

        waits, misses = [], []
        for r in requests:
            if not r.fetch_k:
                continue
            got = self._ahead.pop(r.seq_id, None)
            if got and got[0].tokens == r.tokens and got[0].params == r.params and got[0].num_speculative_tokens >= r.fetch_k:
                waits.append((r, got[2], got[1]))
                self.prefetch_hits += 1
            else:
                misses.append(r)
        if misses:
            task = self._draft([ProposeRequest(r.seq_id, r.tokens, r.fetch_k, r.params, r.feature) for r in misses])
            waits += [(r, task, i) for i, r in enumerate(misses)]
        ok = True
        for r, task, i in waits:
            try:
                p = (await task)[i]
            except Exception:  # a lost drafter costs this round its drafts, nothing else
                log.warning("drafter call failed; verifying without drafts", exc_info=True)
                self.draft_failures += 1
                ok = False
                continue
            k = r.fetch_k
            r.draft_token_ids, r.draft_probs = p.token_ids[:k], None if p.probs is None else p.probs[:k]
        return ok

    def _prefetch(self, requests, results) -> None:
        """Ask the Drafter for the next round's drafts now, before the results go back."""
        from specdec.protocol import ProposeRequest

        ahead = [ProposeRequest(r.seq_id, r.tokens + res.token_ids, r.prefetch_k, r.params, res.feature)
                 for r, res in zip(requests, results) if r.prefetch_k > 0 and r.seq_id not in self._freed]
        if not ahead:
            return
        task = self._draft(ahead)
        # retrieve a failure here too, so an unclaimed one is not reported as never retrieved
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        for i, req in enumerate(ahead):
            self._ahead[req.seq_id] = (req, i, task)
            self._ahead.move_to_end(req.seq_id)
        self.prefetched += len(ahead)
        while len(self._ahead) > 4 * self.args.max_seqs:  # never claimed: sequences that ended
            self._ahead.popitem(last=False)

    def free(self, seq_ids: list[str]) -> None:
        with self._lock:
            for s in seq_ids:
                self.verifier.free(s)
                self._ahead.pop(s, None)
                self._forget(s)

    def stats(self) -> dict:
        v = self.verifier
        return {**self.where(), "passes": v.passes, "batch_sizes": list(v.batch_sizes), "busy_s": v.busy_s,
                "resident_sequences": sorted(v.runner.slots), "evictions": v.runner.evictions, "layouts": self.layouts,
                "prefix_hits": v.runner.prefix_hits, "prefix_tokens_reused": v.runner.prefix_tokens_reused,
                "prefetched": self.prefetched, "prefetch_hits": self.prefetch_hits, "draft_failures": self.draft_failures,
                "ahead_decoded": v.ahead_decoded, "ahead_served": v.ahead_served}
