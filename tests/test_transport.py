"""Which way a call to a replica travels (deployments/transport.py), without Ray."""
import torch

from deployments.transport import Transport, sampled_drafts, verify_bytes
from specdec.protocol import Proposal, ProposeRequest, VerifyRequest
from specdec.sampling import SamplingParams


class FakeHandle:
    def __init__(self, by_reference=True):
        self.by_reference = by_reference

    def options(self, _by_reference=True):
        return FakeHandle(_by_reference)


def test_small_calls_go_by_value_big_ones_by_reference():
    t = Transport(FakeHandle(), max_bytes=1000)
    assert not t.pick(0).by_reference and not t.pick(1000).by_reference
    assert t.pick(1001).by_reference
    assert not Transport(None)


def test_sampled_drafts_count_their_q_rows_once_the_vocabulary_is_known():
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7)
    reqs = [ProposeRequest("a", [1, 2], 4, greedy), ProposeRequest("b", [1, 2], 3, sampled)]
    assert sampled_drafts(reqs) == 3
    t = Transport(FakeHandle(), max_bytes=1 << 20)
    assert t.q_bytes(0) == 0 and t.pick(t.q_bytes(3)).by_reference  # width unknown: assume big
    t.learn([Proposal([5], None), Proposal([5, 6, 7], torch.zeros(3, 100))])
    assert t.vocab == 100 and t.q_bytes(3) == 1200 and not t.pick(t.q_bytes(3)).by_reference
    vreqs = [VerifyRequest("a", [1], [5, 6], torch.zeros(2, 100), sampled), VerifyRequest("b", [1], [], None, greedy)]
    assert verify_bytes(vreqs) == 800


class RecordingHandle:
    """A replica handle whose `free` calls are recorded as (name, ids)."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def options(self, **_):
        return self

    @property
    def free(self):
        handle = self

        class Method:
            def remote(self, ids):
                handle.calls.append((handle.name, ids))
        return Method()


def test_a_rounds_frees_are_one_call_per_replica_and_skip_a_drafter_never_asked():
    from deployments.config import AppArgs
    from deployments.driver import Entry, RoundLoop
    from specdec.sequence import Sequence

    calls = []
    loop = RoundLoop(RecordingHandle("drafter", calls), RecordingHandle("verifier", calls), AppArgs(max_batch_size=4))
    entries = [Entry(Sequence(sid, [1, 2], SamplingParams(), 4, 64), 0.0, shard="shard-0", proposer="draft",
                     on_drafter=sid == "b") for sid in "abc"]
    loop._free(*entries)
    assert calls == [("verifier", ["a", "b", "c"]), ("drafter", ["b"])]
    calls.clear()
    loop._free(entries[0])  # never drafted for: the Drafter holds nothing of it
    assert calls == [("verifier", ["a"])]
