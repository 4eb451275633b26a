"""The round loop's failure handling (deployments/driver.py), with an in-process Verifier behind
a fake handle: a call whose replica's code raises is not retried and fails only the sequence
that raises; an unavailable replica is retried; every failure is counted by deployment and cause."""
import asyncio

import pytest
from ray.exceptions import ActorUnavailableError

from deployments.config import AppArgs
from deployments.driver import RoundLoop, failure_cause
from deployments.openai_protocol import APIError
from specdec.protocol import Proposal
from specdec.sampling import SamplingParams
from specdec.sequence import Sequence


class FakeVerifier:
    """A Verifier handle: calls run the in-process verifier, unless `fault(requests)` returns
    an exception to raise instead."""

    def __init__(self, verifier, fault=lambda reqs: None):
        self.verifier, self.fault, self.calls = verifier, fault, []
        handle = self

        class Verify:
            async def remote(self, reqs):
                handle.calls.append([r.seq_id for r in reqs])
                exc = handle.fault(reqs)
                if exc is not None:
                    raise exc
                return handle.verifier.verify(reqs)

        class Free:
            def remote(self, ids):
                for i in ids:
                    handle.verifier.free(i)

        self.verify, self.free = Verify(), Free()

    def options(self, **_):
        return self


@pytest.fixture
def verifier(tiny_target):
    from specdec.models.runner import ModelRunner
    from specdec.verifier import Verifier

    return Verifier(ModelRunner(tiny_target, 8, 128))


def run_loop(handle, seqs, **args):
    """Each sequence's output ids, or the APIError it ended with; and the failures counted."""
    loop = RoundLoop(None, handle, AppArgs(max_batch_size=8, adaptive=False, decode_steps=1, **args))
    failures = []
    loop.observe_failure = lambda deployment, cause, retried=False: failures.append((deployment, cause, retried))

    async def one(entry):
        try:
            while not (await loop.next_delta(entry)).finished:
                pass
            return entry.seq.output_ids
        except APIError as err:
            return err

    async def main():
        return await asyncio.gather(*(one(loop.submit(s, None, 60)) for s in seqs))

    return asyncio.run(main()), failures


def seq(sid, prompt=(5, 6, 7, 8), k=0):
    return Sequence(sid, list(prompt), SamplingParams(max_tokens=6, ignore_eos=True), k, 128)


def test_causes():
    assert failure_cause(ValueError("x")) == "error"  # by value, the replica's exception itself
    assert failure_cause(asyncio.TimeoutError()) == "timeout"
    assert failure_cause(ActorUnavailableError("gone", None)) == "unavailable"


def test_a_sequence_that_raises_fails_alone_and_is_not_retried(verifier):
    fault = lambda reqs: ValueError("poisoned input") if any(r.seq_id == "bad" for r in reqs) else None  # noqa: E731
    handle = FakeVerifier(verifier, fault)
    want, _ = run_loop(FakeVerifier(verifier), [seq(f"ref-{i}", (5 + i, 6, 7)) for i in range(3)])
    got, failures = run_loop(handle, [seq(f"good-{i}", (5 + i, 6, 7)) for i in range(3)] + [seq("bad")])
    assert got[:3] == want  # the others finish, with the tokens they would have had anyway
    assert isinstance(got[3], APIError) and got[3].status == 400 and "poisoned input" in got[3].message
    # the batch raised once, then each sequence ran alone once: "bad" was tried twice in all
    assert sum("bad" in c for c in handle.calls) == 2 and handle.calls[0] == ["good-0", "good-1", "good-2", "bad"]
    assert failures == [("Verifier", "error", False)] * 2


def test_an_internal_error_is_a_500_for_that_sequence(verifier):
    got, failures = run_loop(FakeVerifier(verifier, lambda reqs: RuntimeError("kernel bug")), [seq("a")])
    assert got[0].status == 500 and got[0].type == "server_error" and failures == [("Verifier", "error", False)]


def test_an_unavailable_verifier_is_retried_then_503(verifier):
    tries = []

    def flaky(reqs):  # the first two calls find no replica, then one answers
        tries.append(1)
        return ActorUnavailableError("restarting", None) if len(tries) <= 2 else None

    got, failures = run_loop(FakeVerifier(verifier, flaky), [seq("a")])
    assert len(got[0]) == 6 and failures == [("Verifier", "unavailable", True)] * 2
    got, failures = run_loop(FakeVerifier(verifier, lambda reqs: ActorUnavailableError("gone", None)), [seq("b")],
                             verifier_retry_s=0.5)
    assert got[0].status == 503 and failures[-1] == ("Verifier", "unavailable", False) and len(failures) >= 2


class FakeDrafter:
    """A Drafter handle that drafts nothing, and raises for a call that includes sequence 'bad'."""

    def __init__(self):
        self.calls = []
        handle = self

        class Propose:
            def remote(self, reqs):
                handle.calls.append([r.seq_id for r in reqs])

                async def answer():
                    if any(r.seq_id == "bad" for r in reqs):
                        raise ValueError("cannot draft this")
                    return [Proposal([], None) for _ in reqs]
                return asyncio.ensure_future(answer())  # a response can be cancelled, as Serve's

        class Free:
            def remote(self, ids):
                pass

        self.propose, self.free = Propose(), Free()

    def options(self, **_):
        return self


def test_a_sequence_the_drafter_raises_on_stops_drafting_alone(verifier):
    drafter = FakeDrafter()
    # a draft model (a draft head would draft in the Verifier, and no Drafter would be asked)
    loop = RoundLoop(drafter, FakeVerifier(verifier), AppArgs(max_batch_size=8, adaptive=False, decode_steps=1,
                                                              lookup_min_n=0, draft="tiny:noise=0.05"))
    failures = []
    loop.observe_failure = lambda deployment, cause, retried=False: failures.append((deployment, cause))
    seqs = [seq("good", k=2), seq("bad", (9, 8, 7), k=2)]

    async def main():
        entries = [loop.submit(s, "draft", 60) for s in seqs]
        for e in entries:
            while not (await loop.next_delta(e)).finished:
                pass

    asyncio.run(main())
    assert all(len(s.output_ids) == 6 for s in seqs)
    assert failures == [("Drafter", "error")] * 2  # the pair's call, then bad's alone
    first = drafter.calls.index(["good", "bad"])
    assert drafter.calls[first + 1:first + 3] == [["good"], ["bad"]]
    assert all(c == ["good"] for c in drafter.calls[first + 3:]) and len(drafter.calls) > first + 3
    assert loop._drafter_up()  # no back-off: the Drafter answers the others


def test_a_sequence_that_raises_in_the_ingress_fails_alone_and_no_stream_misses_tokens(verifier):
    """The round raises while committing (here the bad sequence's detokenizer): what the others
    had committed before it is still delivered, each then runs alone, and only the bad one fails."""
    def text(ids):
        return "".join(chr(97 + t % 26) for t in ids)

    def broken(ids):
        raise TypeError("cannot decode")

    loop = RoundLoop(None, FakeVerifier(verifier), AppArgs(max_batch_size=8, adaptive=False, decode_steps=1))
    seqs = [Sequence(sid, [5 + i, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True), 0, 128,
                     decode=broken if sid == "bad" else text) for i, sid in enumerate(["good-0", "bad", "good-1"])]
    want, _ = run_loop(FakeVerifier(verifier), [seq(f"ref-{i}", (5 + i, 6, 7)) for i in (0, 2)])

    async def streamed(entry):
        out = ""
        try:
            while not (d := await loop.next_delta(entry)).finished:
                out += d.text
            return out + d.text
        except APIError as err:
            return err

    async def main():
        return await asyncio.gather(*(streamed(loop.submit(s, None, 60)) for s in seqs))

    got = asyncio.run(main())
    assert [seqs[0].output_ids, seqs[2].output_ids] == want
    assert got[0] == text(seqs[0].output_ids) and got[2] == text(seqs[2].output_ids)  # every token streamed once
    assert isinstance(got[1], APIError) and got[1].status == 500
