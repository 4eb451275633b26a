"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the current
suffix (an n-gram of the prompt or output). No model, so q is one-hot at the proposal."""
from __future__ import annotations

from specdec.protocol import Proposal, ProposeRequest


class NgramProposer:
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        return [Proposal(self.lookup(r.tokens, r.num_speculative_tokens), None) for r in requests]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # latest earlier match wins: recent context predicts best
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    def free(self, seq_id: str) -> None:
        pass
