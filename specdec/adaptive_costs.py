"""Adaptive K's cost model: what a round costs at each batch size, learned online.

A speculative round is one verifier call of one pass over the batch's tokens plus a draft call;
a plain round, where plain rounds run several decoding steps per call (multi-step), pays a share
of a call per pass. The two are learned apart: priced as a share of a multi-step call, a one-pass
call just above a batch's plain size looks far cheaper than it is. The verify cost is a curve
over tokens per pass, one per batch size (flat while the weights' memory traffic dominates, steep
once a big batch is compute-bound: no single line fits 1 user and 16)."""
from __future__ import annotations

import numpy as np

VERIFY_PRIOR = (0.06, 0.01)  # s per one-pass call = a + b * tokens, until measured
DRAFT_PRIOR = (0.002, 0.0015)  # s per draft call = a + c * K * B, until measured
LOCAL_DRAFT_PRIOR = (0.0003, 0.0003)  # ... for drafts made next to the verifier (its draft head): no call
PLAIN_REFRESH_EVERY = 64  # choices after which a batch size's plain pass is measured afresh
CURVE_FORGET = 64  # choices after which a verify-curve point not measured since is dropped
EMA_WEIGHT = 0.3  # weight of a new measurement at its size


def ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


class LinearFit:
    """Least squares y = a + b x (b >= 0) over an exponentially weighted window, so it follows
    drift; the prior enters as `weight` pseudo-observations at x = 1 and x = 5."""

    def __init__(self, a: float, b: float, decay: float = 0.97, weight: int = 3):
        self.decay, self.sw, self.sx, self.sy, self.sxx, self.sxy = decay, 0.0, 0.0, 0.0, 0.0, 0.0
        for x in [1.0] * weight + [5.0] * weight:
            self.observe(x, a + b * x)

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.sw, self.sx, self.sy = d * self.sw + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def __call__(self, x: float) -> float:
        var = self.sw * self.sxx - self.sx**2
        b = max((self.sw * self.sxy - self.sx * self.sy) / var if var > 1e-12 else 0.0, 0.0)
        return max((self.sy - b * self.sx) / self.sw + b * x, 1e-6)


class DraftCost:
    """Seconds per draft call of K steps over B sequences.

    Choices price it by a line in K x B: cautious where a call is mostly a remote call, which a
    finer fit finds no dearer for 4 sequences than for 1, making K > 0 for all look like a gain
    it is not. Probes price it by a + b K + c K B (fixed, per step, per sequence-step; b, c >= 0)
    once calls at two batch sizes tell b from c, and until then as one sequence's call: a GPU's
    launch-bound draft step costs about the same for 1 sequence or 16, and priced per sequence the
    probe that would show it never pays."""

    def __init__(self, a: float, c: float, decay: float = 0.97, min_batch_spread: float = 0.5):
        self.line, self.decay, self.min_batch_spread = LinearFit(a, c, decay), decay, min_batch_spread
        self.sff, self.sfy = np.zeros((3, 3)), np.zeros(3)  # weighted sums of f f^T and f y, f = (1, K, K B)
        self.sb = self.sbb = 0.0  # weighted sums of B and B^2

    def observe(self, batch: int, k: int, y: float) -> None:
        self.line.observe(k * batch, y)
        d, f = self.decay, np.array([1.0, k, k * batch])
        self.sff, self.sfy = d * self.sff + np.outer(f, f), d * self.sfy + f * y
        self.sb, self.sbb = d * self.sb + batch, d * self.sbb + batch * batch

    def coef(self) -> tuple[float, float, float] | None:
        """(a, b, c): the best fit, b, c >= 0, among the subsets of terms the calls determine;
        None while their batch sizes are too alike to tell b from c."""
        w = self.sff[0, 0]
        if not w or self.sbb / w - (self.sb / w) ** 2 < self.min_batch_spread ** 2:
            return None
        best, best_err = None, None
        for keep in ((0, 1, 2), (0, 1), (0, 2), (0,)):
            m = self.sff[np.ix_(keep, keep)]
            if np.linalg.cond(m) > 1e9:  # e.g. calls at two (K, B) points only: three terms are not determined
                continue
            theta = np.zeros(3)
            theta[list(keep)] = np.linalg.solve(m, self.sfy[list(keep)])
            # weighted squared error, up to a constant: theta' S theta - 2 theta' r
            err = sum(theta[i] * self.sff[i, j] * theta[j] for i in range(3) for j in range(3)) \
                - 2 * sum(theta * self.sfy)
            if theta[1] >= 0 and theta[2] >= 0 and (best_err is None or err < best_err):
                best, best_err = tuple(float(t) for t in theta), err
        return best

    def optimistic(self, batch: int, k: int) -> float:
        """For deciding a probe: the fit, or while it cannot tell, one sequence's call."""
        if (coef := self.coef()) is None:
            return self.line(k)
        a, b, c = coef
        return max(a + b * k + c * k * batch, 1e-6)

    def __call__(self, batch: int, k: int) -> float:
        """For choosing K: the line in K x B."""
        return self.line(k * batch)


def verify_prior(tokens: float) -> float:
    return VERIFY_PRIOR[0] + VERIFY_PRIOR[1] * tokens


def curve_cost(points: dict[int, float], x: int, optimistic: bool = False) -> float:
    """Seconds per pass of x tokens, given the passes measured at some sizes: linear between them;
    outside, the prior's shape scaled to the nearest size (a prior that says tokens cost something
    keeps unexplored big passes from looking free). optimistic, past the biggest size: the slope
    of the two biggest (flat if one), what a probe may hope for (on a GPU the curve stays flat far
    past where the prior's CPU-like slope says)."""
    prior = verify_prior
    if not points:
        return prior(x)
    if x in points:
        return points[x]
    lo = max((p for p in points if p < x), default=None)
    hi = min((p for p in points if p > x), default=None)
    if lo is not None and hi is not None:
        w = (x - lo) / (hi - lo)
        return (1 - w) * points[lo] + w * points[hi]
    if hi is None and optimistic:
        top = sorted(points)[-2:]
        slope = (points[top[-1]] - points[top[0]]) / (top[-1] - top[0]) if len(top) == 2 else 0.0
        return points[lo] + max(slope, 0.0) * (x - lo)
    near = lo if lo is not None else hi
    return points[near] * prior(x) / prior(near)


class Costs:
    """Per batch size: one-pass calls by tokens in the pass, the per-pass cost of multi-step plain
    calls, and when that was last measured; and the draft calls."""

    def __init__(self):
        self.curves: dict[int, dict[int, float]] = {}  # batch -> tokens in the pass -> s per call (EMA)
        self.curve_seen: dict[int, dict[int, int]] = {}  # batch -> tokens -> when (in choices) last measured
        self.plain: dict[int, float] = {}  # batch -> s per pass of a multi-step plain call (EMA)
        self.plain_seen: dict[int, int] = {}  # batch -> when (counted in choices) it was last measured
        self.draft = DraftCost(*DRAFT_PRIOR)
        self.drafts_in_calls = False

    def local_drafts(self) -> None:
        """Drafts are made in this process (the in-process engine): a draft costs no call. Read
        from the remote call's prior, a head that drafts in 0.5 ms looked 2.7-3.5 ms dear until
        many rounds had drafted, so requests that missed early stayed at K = 0."""
        self.draft = DraftCost(*LOCAL_DRAFT_PRIOR)

    def draft_in_calls(self) -> None:
        """Drafts are made inside multi-step verifier calls (the verifier's own head, before each
        pass): a draft costs no call, and a pass with drafts is priced from the plain pass at its
        batch size until one is measured."""
        self.local_drafts()
        self.drafts_in_calls = True

    def observe_verify(self, batch: int, tokens: int, seconds: float, steps: int, now: int) -> None:
        """seconds per pass of a call that made `steps` passes (steps > 1: plain decoding steps)."""
        if steps == 1:
            curve, seen = self.curves.setdefault(batch, {}), self.curve_seen.setdefault(batch, {})
            curve[tokens], seen[tokens] = ema(curve.get(tokens), seconds), now
            # a point no choice has gone back to is dropped: measured once while the machine was
            # slow, it would price its K out for good (nothing chooses it, so nothing corrects it)
            # and skew the interpolation of its neighbours; without it they are read from the rest
            for t in [t for t, when in seen.items() if now - when > CURVE_FORGET]:
                del curve[t], seen[t]
            return
        # a plain pass measured long ago is replaced, not averaged: one measured while the
        # machine was busy would otherwise make speculating look better for good
        stale = now - self.plain_seen.get(batch, 0) >= PLAIN_REFRESH_EVERY
        self.plain[batch] = ema(None if stale else self.plain.get(batch), seconds)
        self.plain_seen[batch] = now

    def plain_stale(self, batch: int, now: int) -> bool:
        """Its plain pass was measured more than PLAIN_REFRESH_EVERY choices ago."""
        return batch in self.plain and now - self.plain_seen[batch] > PLAIN_REFRESH_EVERY

    def unmeasured(self, batch: int) -> bool:
        """Bigger than every batch size a one-pass call was measured at: only a probe can tell."""
        return bool(self.curves) and batch > max(self.curves)

    def verify(self, batch: int, tokens: int, optimistic: bool = False) -> float:
        """Seconds per one-pass call (optimistic: read hopefully past the longest pass measured)."""
        if self.drafts_in_calls and batch not in self.curves and batch in self.plain:
            return self.plain[batch] * verify_prior(tokens) / verify_prior(batch)
        if batch in self.curves or not self.curves:
            return curve_cost(self.curves.get(batch, {}), tokens, optimistic)
        near = min(self.curves, key=lambda b: abs(b - batch))
        # scaled as the two sizes' plain passes compare where both were measured: by the batch
        # ratio, an unmeasured size's one-pass call can come out no dearer than its plain pass
        plain, plain_near = self.plain.get(batch), self.plain.get(near)
        scale = plain / plain_near if plain and plain_near else batch / near
        cost = curve_cost(self.curves[near], round(tokens * near / batch), optimistic) * scale
        if batch > near and tokens > batch:  # perhaps compute-bound: a draft costs as much as a sequence's token
            cost = max(cost, self.verify(batch, batch) * tokens / batch)
        return cost
