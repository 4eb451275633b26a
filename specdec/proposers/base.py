from __future__ import annotations

from typing import Protocol

from specdec.protocol import Proposal, ProposeRequest


class Proposer(Protocol):
    """Batched: one call proposes for every sequence in the round."""

    name: str

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]: ...

    def free(self, seq_id: str) -> None:
        """Forget a finished sequence (no-op for stateless proposers)."""
