"""Which way a call to a model replica travels: by value over Serve's gRPC transport, or by
reference through Ray's object store (Serve's default), picked per call by its size.

By value is ~2 ms cheaper per call here (bench/calls.py, bench/results/calls.json: one
sequence's verify call 4.2 -> 2.6 ms, sixteen's 8.0 -> 6.0, a sampled one with 0.8 MB of q rows
7.0 -> 4.5), which a speculative round pays once or twice. At 3 MB the two cost the same, and a
replica's gRPC server takes messages up to 4 MB (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH):
sampled drafts carry their q rows, [K, V] float32 per sequence (SmolLM2: 192 KB a draft), so a
call whose messages may be big goes by reference, as Ray itself keeps big objects out of its
RPCs."""
from __future__ import annotations

BY_VALUE_MAX_BYTES = 1 << 20  # above this a call goes by reference (gRPC's limit is 4 MB)


class Transport:
    """A replica handle's two ways, picked per call by the bytes the call may carry."""

    def __init__(self, handle, max_bytes: int = BY_VALUE_MAX_BYTES):
        self.by_reference = handle
        self.by_value = handle.options(_by_reference=False) if handle is not None else None
        self.max_bytes = max_bytes
        # q rows' width, learned from the first proposal that carries them; until then a sampled
        # draft counts as too big
        self.vocab: int | None = None

    def __bool__(self) -> bool:
        return self.by_reference is not None

    def pick(self, nbytes: int):
        return self.by_value if self.by_value is not None and nbytes <= self.max_bytes else self.by_reference

    def learn(self, proposals) -> None:
        if self.vocab is None:
            self.vocab = next((p.probs.shape[-1] for p in proposals if p.probs is not None), None)

    def for_proposals(self, requests):
        """The handle for a Drafter call that proposes for these ProposeRequests."""
        return self.pick(self.q_bytes(sampled_drafts(requests)))

    def q_bytes(self, num_sampled_drafts: int) -> int:
        """Bytes of the q rows of this many sampled drafts (greedy drafts carry none)."""
        if not num_sampled_drafts:
            return 0
        return num_sampled_drafts * 4 * self.vocab if self.vocab else self.max_bytes + 1


def sampled_drafts(requests) -> int:
    """Drafts that will carry q rows: those of sampled (non-greedy) requests."""
    return sum(r.num_speculative_tokens for r in requests if not r.params.greedy)


def verify_bytes(requests) -> int:
    """What a verify call's requests carry in q rows."""
    return sum(r.draft_probs.numel() * r.draft_probs.element_size() for r in requests if r.draft_probs is not None)
