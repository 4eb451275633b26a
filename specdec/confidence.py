"""Which drafts of a round are worth their place in the verifier pass (EAGLE-2's dynamic trees).

A draft's confidence (`Proposal.scores`) is the draft's probability of its whole path. Calibrated
against what the verifier accepted (per bin of confidence, greedy and sampled requests apart,
forgetting old rounds), it estimates the draft's probability of being accepted, which is what it
adds to the tokens a pass yields (a pass yields one token plus one per accepted draft). `prune`
keeps, over the whole batch, the most confident drafts up to the count that maximises expected
tokens per second of the pass (the verify-cost curve per batch size); a draft is never rated
above its parent, so it is kept only with it: deep drafts where the head is sure, wide trees where it hesitates between few tokens,
nothing where it guesses.
"""
from __future__ import annotations

from dataclasses import replace

from specdec.protocol import Proposal, VerifyResult

BINS = 10  # confidence bins over [0, 1]
# a head drafts past its first draft only while its path is at least this likely: deeper guesses
# it thinks more likely wrong than right rarely pay for their draft step and their row in the
# pass, and adaptive K, choosing K from acceptance records, expects too much of them (paired
# 24-prompt A/Bs against K=0, adaptive K without and with this stop: greedy 1.112x -> 1.157x,
# 1.113x -> 1.161x; sampled 1.074x -> 1.145x, 1.080x -> 1.105x)
MIN_PATH_CONFIDENCE = 0.5
# and it takes a step past a draft only where its path could stay at the floor with a next draft
# the head gives this probability (path >= floor / 0.7): stepping on wherever the path reached the
# floor, the head often made a draft (~0.4 ms before the pass) that only a surer guess than it
# makes would have kept (paired 24-prompt A/Bs against K=0, stepping on at the floor vs at floor
# / 0.7: greedy 1.163x -> 1.194x, 1.132x -> 1.147x; sampled 1.118x -> 1.156x, 1.115x -> 1.142x)
NEXT_DRAFT_CONFIDENCE = 0.7
PRIOR_WEIGHT = 4.0  # pseudo-drafts behind each bin's prior, the confidence itself
DECAY = 0.995  # per draft observed: how fast a bin forgets


class Confidence:
    """Acceptance of drafts by their confidence, learned from verified rounds."""

    def __init__(self):
        self.drafts = {g: [0.0] * BINS for g in (True, False)}  # by greedy, per bin: drafts verified, decayed
        self.hits = {g: [0.0] * BINS for g in (True, False)}  # of those, accepted

    def acceptance(self, score: float, greedy: bool) -> float:
        b = _bin(score)
        return (self.hits[greedy][b] + PRIOR_WEIGHT * score) / (self.drafts[greedy][b] + PRIOR_WEIGHT)

    def observe(self, proposals: list[Proposal], results: list[VerifyResult], greedy: list[bool]) -> None:
        for p, r, g in zip(proposals, results, greedy):
            if not p.scores or not p.token_ids:
                continue
            kept = set(r.path) if r.path is not None else set(range(r.num_accepted))
            n, h = self.drafts[g], self.hits[g]
            for j, score in enumerate(p.scores):
                b = _bin(score)
                n[b] = DECAY * n[b] + 1.0
                h[b] = DECAY * h[b] + (j in kept)

    def state(self) -> dict:
        return {("greedy" if g else "sampled"): [round(self.acceptance((b + 0.5) / BINS, g), 3) for b in range(BINS)]
                for g in (True, False)}


def _bin(score: float) -> int:
    return min(int(score * BINS), BINS - 1)


def prune(proposals: list[Proposal], greedy: list[bool], conf: Confidence, pass_cost, tokens: int) -> list[Proposal]:
    """The scored proposals cut to their drafts worth verifying. pass_cost(n): seconds of the pass
    with n scored drafts in it; tokens: what the pass yields without them (one per sequence)."""
    rated = []
    for i, (p, g) in enumerate(zip(proposals, greedy)):
        rates: list[float] = []
        for j, score in enumerate(p.scores if p.token_ids and p.scores else []):
            parent = _parent(p, j)  # a draft is accepted only after its parent: never likelier
            rates.append(min(conf.acceptance(score, g), rates[parent] if parent >= 0 else 1.0))
            rated.append((rates[-1], i, j))
    order = sorted(rated, key=lambda x: (-x[0], x[1], x[2]))  # parents before their children
    taken, gain = [], 0.0
    best, best_rate = 0, tokens / pass_cost(0)
    for a, i, j in order:
        taken.append((i, j))
        gain += a
        rate = (tokens + gain) / pass_cost(len(taken))
        if rate > best_rate:
            best, best_rate = len(taken), rate
    keep: list[set[int]] = [set() for _ in proposals]
    for i, j in taken[:best]:
        keep[i].add(j)
    return [subset(p, keep[i]) if p.scores and p.token_ids else p for i, p in enumerate(proposals)]


def _parent(p: Proposal, j: int) -> int:
    return j - 1 if p.parents is None else p.parents[j]


def subset(p: Proposal, keep: set[int]) -> Proposal:
    """The drafts at `keep` (a parent kept with each), renumbered in their order."""
    idx = sorted(keep)
    if len(idx) == len(p.token_ids):
        return p
    new = {j: n for n, j in enumerate(idx)}
    return replace(p, token_ids=[p.token_ids[j] for j in idx],
                   probs=None if p.probs is None else p.probs[idx],
                   parents=None if p.parents is None else [new.get(p.parents[j], -1) for j in idx],
                   scores=None if p.scores is None else [p.scores[j] for j in idx])
