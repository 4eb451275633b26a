"""Copies as drafts. Prompt lookup proposes the tokens that followed the latest earlier occurrence
of the current suffix (an n-gram of the prompt or output); a prediction (OpenAI's Predicted
Outputs: text the answer is expected to repeat) proposes its own tokens from where the output
meets it. No model, so q is one-hot at the proposal."""
from __future__ import annotations

import numpy as np

from specdec.protocol import Proposal, ProposeRequest

START = -1  # stands before an output and its prediction: only their starts match it


def suffix_runs(src: np.ndarray, query: np.ndarray, n_max: int) -> np.ndarray:
    """run[j]: how many of query's last tokens (at most n_max) equal src's tokens ending at j.
    Vectorised with numpy, and only the ends still matching are compared again (it runs every
    round, and in the Verifier before every pass: torch's list-to-tensor conversion alone costs
    0.5 ms at 2 k tokens)."""
    run = np.zeros(len(src), dtype=np.int64)
    if not n_max or not len(query):
        return run
    alive = np.flatnonzero(src == query[-1])  # ends whose last i + 1 tokens match
    for i in range(1, min(n_max, len(query)) + 1):
        run[alive] += 1
        if i == min(n_max, len(query)):
            break
        alive = alive[alive >= i]
        alive = alive[src[alive - i] == query[-1 - i]]
    return run


def predicted(prediction: np.ndarray | list[int], output: list[int], k: int, min_n: int = 2,
              max_n: int = 8) -> list[int]:
    """The k prediction tokens after where the output's end meets the prediction: the longest
    suffix of the output (at most max_n tokens, at least min_n, the output's start counting as a
    token that only the prediction's start matches) that occurs in the prediction, at the
    occurrence nearest the output's own length (an edit keeps most text where it was, and a
    repeated line must not send the copy back to its first occurrence); [] if none. Before the
    output has a token, the prediction's start."""
    prediction = np.asarray(prediction, dtype=np.int64)  # a Sequence's is an array already
    if k <= 0 or not prediction.size:
        return []
    if not output:
        return prediction[:k].tolist()
    src = np.concatenate(([START], prediction[:-1]))  # src[j] is followed by prediction[j]
    query = np.asarray(([START] + output)[-max_n:])  # all that a match of max_n tokens reads
    run = suffix_runs(src, query, max_n)
    best = int(run.max())
    if best < min_n:
        return []
    at = np.flatnonzero(run == best)
    j = int(at[np.argmin(np.abs(at - len(output)))])
    return prediction[j : j + k].tolist()


class NgramProposer:
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        return [Proposal(self.lookup(r.tokens, r.num_speculative_tokens), None) for r in requests]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest suffix (max_n down to
        min_n tokens) that occurs earlier; [] if none does."""
        L = len(tokens)
        n_max = min(self.max_n, L - 1)
        if k <= 0 or n_max < self.min_n:
            return []
        t = np.asarray(tokens)
        run = suffix_runs(t[: L - 1], t, n_max)  # [L-1]: matches ending before the last token
        best = int(run.max())
        if best < self.min_n:
            return []
        j = int(np.flatnonzero(run == best)[-1])  # latest match wins: recent context predicts best
        return tokens[j + 1 : j + 1 + k]

    def index(self) -> "SuffixIndex":
        """A growing sequence's own index, for lookups round after round (Round keeps it on the
        Sequence)."""
        return SuffixIndex(self.min_n, self.max_n)

    def free(self, seq_id: str) -> None:
        pass


class SuffixIndex:
    """NgramProposer.lookup for one sequence whose tokens only grow: where each of its n-grams
    (min_n..max_n tokens) last ended, before its last token, kept up to date as tokens arrive.
    A round's lookup is then a few dict reads, where scanning the whole context again took
    ~0.13 ms of every drafting round (the 24 bench prompts, in process, on a 2-core CPU)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest occurrence ends
        self.indexed = 0  # n-grams ending before this are in `ends`

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        if L - 1 < self.indexed:  # cut back (a stop string ends it): indexed afresh
            self.ends, self.indexed = {}, 0
        for j in range(self.indexed, L - 1):  # a match ends before the suffix's own last token
            for n in range(self.min_n, min(self.max_n, j + 1) + 1):
                self.ends[tuple(tokens[j + 1 - n : j + 1])] = j
        self.indexed = max(self.indexed, L - 1)
        if k <= 0:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            if (j := self.ends.get(tuple(tokens[L - n :]))) is not None:
                return tokens[j + 1 : j + 1 + k]
        return []


def lookup_proposer(min_n: int, max_n: int = 4) -> NgramProposer | None:
    """The prompt lookup tried before a model proposer (`Round`): matches of at least min_n
    tokens; None when min_n is 0 (off)."""
    return NgramProposer(max_n=max(max_n, min_n), min_n=min_n) if min_n > 0 else None
