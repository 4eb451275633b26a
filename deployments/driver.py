"""The continuous-batching round loop that drives remote Drafter and Verifier replicas.

Each shard (a group of sequences that sticks to one drafter and one verifier replica, routed as
a Serve multiplexed id) runs its own loop: every round takes the shard's active sequences (up to
max_batch_size), asks the Drafter for all of their proposals in one call (a draft model; a draft
head drafts inside the Verifier's call), asks the Verifier to check all of them (in one pass, or
several where no Drafter drafts), and commits. Users join and leave between rounds, so a lone user never waits for a batch to fill. The loop
holds the authoritative token lists; replicas only cache, so a failed or replaced replica costs
a recompute, never a token.

A call that fails because a replica is unavailable (dead, restarting, unreachable) is retried; one
whose replica's code raised is not (the same call raises again): the batch's sequences then run
alone, so the sequence that raises fails by itself and the others go on."""
from __future__ import annotations

import asyncio
import collections
import logging
import time
import zlib
from dataclasses import dataclass, field

from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import RayServeException

from specdec.adaptive import AdaptiveK
from specdec.protocol import Proposal
from specdec.proposers import NgramProposer, lookup_proposer
from specdec.rounds import Round
from specdec.sequence import Delta, Sequence

from deployments.config import AppArgs
from deployments.openai_protocol import APIError
from deployments.transport import Transport, verify_bytes

log = logging.getLogger("ray.serve")


def failure_cause(exc: BaseException) -> str:
    """Why a replica call failed: 'timeout'; 'error', the replica's own code raised (by reference
    it arrives as a RayTaskError, by value as the exception itself), so the same call fails the
    same way again; or 'unavailable', the replica died, is restarting or could not be reached, and
    another try may find one."""
    import grpc

    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, RayTaskError):
        return "unavailable" if isinstance(exc.cause, (RayError, RayServeException)) else "error"
    if isinstance(exc, (RayError, RayServeException, grpc.RpcError, ConnectionError)):
        return "unavailable"
    return "error"


def replica_error(deployment: str, exc: BaseException) -> APIError:
    """A request's own failure on a replica: 400 when the replica judged its input invalid
    (ValueError, e.g. a context overflow), else 500."""
    bad_input = isinstance(exc, ValueError)
    return APIError(400 if bad_input else 500, f"the {deployment} failed on this request: {exc}",
                    "invalid_request_error" if bad_input else "server_error",
                    code="invalid_value" if bad_input else f"{deployment.lower()}_error")


class CallFailed(Exception):
    """A Verifier call whose replica's code raised (not retried)."""

    def __init__(self, exc: BaseException):
        super().__init__(str(exc))
        self.exc = exc


@dataclass
class Entry:
    seq: Sequence
    deadline: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # Delta or APIError items
    shard: str = ""
    proposer: str | None = None  # 'draft' (the Drafter deployment), 'ngram' (local) or None
    aborted: bool = False
    on_drafter: bool = False  # the Drafter was asked for its drafts (so may hold its state)
    sent: tuple[int, int] = (0, 0)  # output tokens and characters of text delivered to the queue


class RoundLoop:
    def __init__(self, drafter, verifier, args: AppArgs, adaptive: AdaptiveK | None = None, observe_call=None):
        self.drafter, self.verifier = Transport(drafter), Transport(verifier)
        self.args = args
        self.adaptive = adaptive
        if adaptive is not None:
            adaptive.multi_step = args.decode_steps > 1  # its plain rounds are then priced by multi-step calls only
            if adaptive.multi_step and args.draft_in_verifier:
                adaptive.costs.draft_in_calls()
        self.observe_call = observe_call or (lambda deployment, seconds: None)  # (name, s) per remote call
        # (name, cause, retried) per failed remote call; the ingress points it at its metrics
        self.observe_failure = lambda deployment, cause, retried=False: None
        self._drafter_down_until = 0.0  # after a failure, rounds skip the drafter (K=0) until then
        self._drafter_backoff = 1.0
        self.local = {"ngram": NgramProposer(max_n=args.ngram_max)}  # needs no model: runs right here
        # a draft head drafts in the Verifier's own calls, before each of their passes
        self.in_verifier = frozenset({"draft"} if args.draft_in_verifier else ())
        # prompt lookup before the Drafter: a match saves that sequence's draft (and, if every
        # sequence matches, the whole Drafter call)
        self.lookup = lookup_proposer(args.lookup_min_n, args.ngram_max)
        self.proposer_of: dict[str, str | None] = {}
        self.shards: dict[str, list[Entry]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self.rounds = 0
        self.drafter_failures = 0
        self.verifier_failures = 0
        # the last rounds, for operators and benchmarks: what adaptive K chose and what it cost
        self.trace: collections.deque[dict] = collections.deque(maxlen=512)
        # per shard: the last round, its start and its draft seconds, until its cost is known
        self._unpriced: dict[str, tuple[Round, float, float]] = {}

    @property
    def in_flight(self) -> int:
        return sum(len(v) for v in self.shards.values())

    def shard_of(self, seq_id: str) -> str:
        return f"shard-{zlib.crc32(seq_id.encode()) % self.args.num_shards}"

    def submit(self, seq: Sequence, proposer: str | None, timeout_s: float) -> Entry:
        shard = self.shard_of(seq.seq_id)
        e = Entry(seq, time.monotonic() + timeout_s, shard=shard, proposer=proposer)
        self.proposer_of[seq.seq_id] = proposer
        self.shards.setdefault(shard, []).append(e)
        self._wake.setdefault(shard, asyncio.Event()).set()
        task = self._tasks.get(shard)
        if task is None or task.done():
            self._tasks[shard] = asyncio.get_running_loop().create_task(self._shard_loop(shard))
        return e

    async def prompt_logprobs(self, seq: Sequence, n: int) -> list:
        """The prompt's logprobs ([len(prompt) - 1] TokenLogprobs), computed on the Verifier replica
        the sequence's rounds will go to, which keeps its prompt cached for them. By reference: a
        long prompt's alternatives can outgrow a by-value message."""
        handle = self.verifier.by_reference.options(multiplexed_model_id=self.shard_of(seq.seq_id))
        try:
            return await handle.prompt_logprobs.remote(seq.seq_id, list(seq.prompt_ids), n)
        except Exception as exc:
            cause = failure_cause(exc)
            self.observe_failure("Verifier", cause)
            log.warning("prompt logprobs call failed (%s)", cause, exc_info=True)
            if cause == "error":
                raise replica_error("Verifier", exc) from None
            raise APIError(503, "verifier unavailable; retry later", "server_error", code="service_unavailable",
                           headers={"Retry-After": "2"}) from None

    def release(self, seq: Sequence) -> None:
        """Free a sequence's Verifier cache that no round loop entry owns (a scored prompt)."""
        self.verifier.pick(0).options(multiplexed_model_id=self.shard_of(seq.seq_id)).free.remote([seq.seq_id])

    def abort(self, e: Entry) -> None:
        """Client went away or the request failed: stop generating and free its caches."""
        entries = self.shards.get(e.shard, [])
        if e in entries:
            entries.remove(e)
            e.aborted = True
            self._free(e)

    def _free(self, *entries: Entry) -> None:
        """Free the entries' (one shard's) caches: one call per replica, and none to a Drafter
        that was never asked about them (a round's calls cost the ingress and the replica CPU
        time on a machine whose cores the verifier's pass wants: under load, where adaptive K
        keeps drafts off, a free per finished request was a Drafter call per request for nothing)."""
        if not entries:
            return
        for e in entries:
            self.proposer_of.pop(e.seq.seq_id, None)
        shard = entries[0].shard
        self.verifier.pick(0).options(multiplexed_model_id=shard).free.remote([e.seq.seq_id for e in entries])
        drafted = [e.seq.seq_id for e in entries if e.on_drafter]
        if drafted and self.drafter:
            self.drafter.pick(0).options(multiplexed_model_id=shard).free.remote(drafted)

    async def _shard_loop(self, shard: str) -> None:
        entries, wake = self.shards[shard], self._wake[shard]
        while True:
            if not entries:
                self._price(shard, None)  # the loop goes idle: that round ended with its commit
                wake.clear()
                await wake.wait()
                continue
            batch = entries[: self.args.max_batch_size]
            try:
                await self._round(shard, list(batch))
            except Exception as exc:  # never let one bad round kill the loop, or fail a batch for one sequence
                log.exception("a round of %d sequences failed", len(batch))
                self._catch_up(shard, batch)
                live = [e for e in batch if e in entries]
                if len(batch) == 1:
                    for e in live:
                        self._fail(e, APIError(500, f"internal error: {exc}", "server_error", code="internal_error"))
                else:
                    await self._each_alone(shard, live)

    def _catch_up(self, shard: str, batch: list[Entry]) -> None:
        """Deliver what a round that raised had committed before it raised, so that no stream misses
        tokens its sequence holds."""
        for e in batch:
            seq, (n, t) = e.seq, e.sent
            if e.aborted or len(seq.output_ids) <= n:
                continue
            self._deliver(shard, [e], [(seq, Delta(seq.output_ids[n:], seq.text[t:], seq.finished, seq.finish_reason,
                                                   None if seq.logprobs is None else seq.logprobs[n:]))])

    async def _each_alone(self, shard: str, batch: list[Entry]) -> None:
        """A round of each sequence alone (once: the rounds after go back to batching), so that
        only a sequence that fails alone fails, and the rest go on."""
        log.warning("the %d sequences of a failed round run alone", len(batch))
        for e in batch:
            if e.aborted:
                continue
            try:
                await self._round(shard, [e])
            except Exception as exc:
                log.exception("a round of sequence %s failed", e.seq.seq_id)
                self._catch_up(shard, [e])
                self._fail(e, APIError(500, f"internal error: {exc}", "server_error", code="internal_error"))

    def _price(self, shard: str, now: float | None) -> None:
        """Tell adaptive K what the shard's last round cost: from its start to the next round's,
        so the ingress's own work per round (commit, streaming, the next round's set-up) is counted;
        a round of 4 plain steps pays it once, a speculative round every time. now None: it was
        the last before the loop idled, and cost until its commit."""
        last = self._unpriced.pop(shard, None)
        if last is not None:
            rnd, t_start, t_drafts = last
            rnd.observe_cost((now if now is not None else rnd.t_committed) - t_start - t_drafts)

    async def _round(self, shard: str, batch: list[Entry]) -> None:
        t_start = time.perf_counter()
        self._price(shard, t_start)
        now = time.monotonic()
        for e in [e for e in batch if now > e.deadline]:
            self._fail(e, APIError(408, "request timed out", "timeout", code="timeout"))
            batch.remove(e)
        if not batch:
            return
        rnd = Round([e.seq for e in batch], self.proposer_of, self.adaptive, self.lookup, self.in_verifier)
        for name, (idx, reqs) in rnd.propose_requests().items():
            if name == "draft":
                for i in idx:
                    batch[i].on_drafter = True
            t0 = time.perf_counter()
            rnd.set_proposals(idx, await self._propose(shard, name, reqs), time.perf_counter() - t0)
        try:
            answer = await self._verify(shard, rnd.verify_requests(self.args.decode_steps, self.args.prefill_steps))
        except CallFailed as failed:
            await self._isolate(shard, batch, failed.exc)
            return
        if answer is None:
            for e in batch:
                self._fail(e, APIError(503, "verifier unavailable; retry later", "server_error",
                                       code="service_unavailable", headers={"Retry-After": "2"}))
            return
        results, t_verify = answer
        self.observe_call("Verifier", t_verify)
        self.rounds += 1
        # adaptive K is told what the round cost once the next one starts: the period between
        # rounds counts the ingress's own work too, not just the call
        committed = rnd.commit(results, None)
        self._trace(rnd, results, t_start, t_verify)
        self._unpriced[shard] = (rnd, t_start, rnd.t_draft)
        self._deliver(shard, batch, committed)

    async def _isolate(self, shard: str, batch: list[Entry], exc: BaseException) -> None:
        """The Verifier's code raised on this batch. A sequence alone fails with the error; in a
        batch each sequence gets a round of its own (once: the rounds after go back to batching),
        so only a sequence that raises alone fails, and the rest go on."""
        if len(batch) == 1:
            self._fail(batch[0], replica_error("Verifier", exc))
        else:
            await self._each_alone(shard, batch)

    def _trace(self, rnd: Round, results, t_start: float, t_verify: float) -> None:
        t_round = time.perf_counter() - t_start - rnd.t_draft  # the round so far, its draft calls apart
        self.trace.append({"t": round(t_start, 4), "batch": len(rnd.batch), "prefill": rnd.prefill_verify,
                           "ks": list(rnd.ks), "lookup": [int(x) for x in rnd.is_lookup],
                           "drafted": [r.num_drafted for r in results],
                           "accepted": [r.num_accepted for r in results], "steps": max(r.num_passes for r in results),
                           "emitted": [len(r.token_ids) for r in results],
                           "verify_s": round(t_verify, 4), "round_s": round(t_round, 4), "draft_s": round(rnd.t_draft, 4),
                           # the Verifier's passes inside its call (the rest of verify_s is the call itself)
                           "passes_s": round(sum(results[0].passes_s or ()), 4),
                           "predicted": rnd.prediction})

    def _deliver(self, shard: str, batch: list[Entry], committed: list[tuple[Sequence, Delta]]) -> None:
        """Each request's new tokens to its stream; finished and aborted ones leave the shard."""
        done = []
        for (seq, delta), e in zip(committed, batch):
            if e.aborted:  # aborted while this round was in flight: its calls may have re-cached it
                done.append(e)
                continue
            e.queue.put_nowait(delta)
            e.sent = (len(seq.output_ids), len(seq.text))
            if seq.finished:
                self.shards[shard].remove(e)
                done.append(e)
        self._free(*done)

    def _drafter_up(self) -> bool:
        return time.monotonic() >= self._drafter_down_until

    def _drafter_failed(self) -> None:
        self.drafter_failures += 1
        # while no drafter answers (e.g. its replacement is starting), don't wait for one
        self._drafter_down_until = time.monotonic() + self._drafter_backoff
        log.warning("drafter call failed; rounds run with K=0 for %.0f s", self._drafter_backoff)
        self._drafter_backoff = min(2 * self._drafter_backoff, 10.0)

    async def _propose(self, shard: str, name: str, reqs) -> list[Proposal]:
        if name in self.local:
            return self.local[name].propose(reqs)
        none = [Proposal([], None) for _ in reqs]
        if not self._drafter_up():
            return none
        handle = self.drafter.for_proposals(reqs)
        call = handle.options(multiplexed_model_id=shard).propose.remote(reqs)
        t0 = time.perf_counter()
        try:
            props = await asyncio.wait_for(call, self.args.drafter_timeout_s)
            self.drafter.learn(props)
            self.observe_call("Drafter", time.perf_counter() - t0)
            self._drafter_backoff = 1.0
            return props
        except Exception as exc:  # a lost drafter costs speed, not correctness: verify without drafts
            call.cancel()
            cause = failure_cause(exc)
            self.observe_failure("Drafter", cause)
            log.debug("drafter call failed (%s)", cause, exc_info=True)
            if cause != "error":
                self._drafter_failed()
                return none
        # the Drafter is up but its code raised: backing off would stop drafts for everyone while
        # the sequence that raises lives; alone, each finds out whether it is that one
        self.drafter_failures += 1
        if len(reqs) > 1:
            return [p for r in reqs for p in await self._propose(shard, name, [r])]
        log.warning("the drafter raised on sequence %s; it decodes without drafts from now on", reqs[0].seq_id)
        self.proposer_of[reqs[0].seq_id] = None
        return none

    async def _verify(self, shard: str, reqs):
        """(results, seconds of the call that answered), or None when every try failed. An
        unavailable replica is retried with backoff for up to verify_retry_s: a retry is idempotent
        (another or a restarted replica recomputes from the token lists), so a lost verifier costs
        time only. Raises CallFailed at once when the replica's code raised."""
        give_up, delay = time.monotonic() + self.args.verifier_retry_s, 0.25
        handle = self.verifier.pick(verify_bytes(reqs)).options(multiplexed_model_id=shard)
        while True:
            t0 = time.perf_counter()
            try:
                results = await handle.verify.remote(reqs)
                return results, time.perf_counter() - t0
            except Exception as exc:
                self.verifier_failures += 1
                cause = failure_cause(exc)
                retry = cause != "error" and time.monotonic() + delay <= give_up
                self.observe_failure("Verifier", cause, retry)
                log.warning("verifier call failed (%s)", cause, exc_info=True)
                if cause == "error":
                    raise CallFailed(exc) from None
                if not retry:
                    return None
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

    def _fail(self, e: Entry, err: APIError) -> None:
        e.queue.put_nowait(err)
        self.abort(e)

    async def next_delta(self, e: Entry) -> Delta:
        """The next block of output, or raises the request's APIError."""
        try:
            item = await asyncio.wait_for(e.queue.get(), timeout=max(0.1, e.deadline - time.monotonic()) + 5)
        except asyncio.TimeoutError:
            self.abort(e)
            raise APIError(408, "request timed out", "timeout", code="timeout")
        if isinstance(item, APIError):
            raise item
        return item
