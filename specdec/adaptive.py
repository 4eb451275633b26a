"""Adaptive speculation: pick K each round to maximise expected tokens per second.

With acceptance a_i at draft position i (given the drafts before it were accepted; a draft's
later guesses are worse, so a_i falls with i), K drafts yield on average
E(K) = 1 + a_1 + a_1 a_2 + ... + a_1...a_K tokens per verifier pass. The a_i are learned over
all sequences; a sequence's own record scales them, and a request with no record yet is expected
to do what requests did in their first drafting round (the overall rate leans on the requests
that drafted most, the ones that accept best). A round costs one draft call (a fixed
part, e.g. an RPC, a part per step and a part per sequence-step) and one verifier pass over all
the batch's tokens. Both are measured online: the verify cost as a curve over tokens per pass (it
is flat while the weights' memory traffic dominates and steep once a big batch makes it
compute-bound, so no single line fits both 1 user and 16), the draft cost as a line in
K x batch (and, for probes, a plane in K and K x batch: a GPU's launch-bound draft step costs
the same for 1 sequence or 16; this CPU's grows with them). K = 0 is chosen whenever
speculation would not pay; a probe round now and then keeps the estimates fresh so speculation
can come back, less and less often while probes keep saying no. Acceptance depends on the
prompt far more than on the draft's average (extractive and list prompts accept 2-3x what chat
does), so every new request is also probed once, at its first round that can draft. A probe,
of either kind, is made only when it would pay were the drafts accepted at a high rate: in a
batch big enough to make the pass compute-bound it cannot, and waits for the load to fall. The
costs it would pay are read hopefully where nothing measured them (a pass longer than any seen
follows the measured slope, not the prior's; a many-sequence draft call is priced per step until
calls at two batch sizes tell), or the probe that would measure them never pays. Drafts
copied by prompt lookup are free to make and accepted very unevenly (near 1 in an extractive
answer, near 0 elsewhere), so they have their own acceptance model and their own K, chosen
together with the model's K because both share the verifier pass.

Where rounds without drafts run several decoding steps per verifier call (Serve's multi-step
scheduling), a plain pass costs its share of a call and a speculative round a whole call: the
per-call overhead (remote call, batch set-up, results) is spread over the steps of one and paid
in full by the other. So the passes of multi-step calls are costed apart from the curves, which
learn from one-pass calls only; mixed, they made a one-pass call just above the batch's plain
size look as cheap as a share of a multi-step one, and cheap lookup drafts in a big batch lost.
A batch size whose plain multi-step pass was never measured decodes plainly first (no drafts, no
probes): guessed from other sizes, its plain pass can look dear enough that speculating every
round seems to pay, and then it is never measured. No probe goes into a round that prefills a
prompt (such rounds are not costed), nor to a request too near its end to use what it shows.
New requests that arrive together share one probe round where that costs less than a round
each. A batch size that has speculated for plain_refresh_every rounds since its plain pass was
measured decodes one round plainly to measure it again: a plain cost measured while the machine
was busy would otherwise keep speculation on for good."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np


class LinearFit:
    """Least-squares y = a + b x over an exponentially weighted window (adapts to drift)."""

    def __init__(self, a: float, b: float, decay: float = 0.97, weight: float = 3.0):
        # the prior enters as `weight` pseudo-observations at x = 1 and x = 5
        self.decay = decay
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        for x in (1.0, 5.0):
            for _ in range(int(weight)):
                self.observe(x, a + b * x)

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.sw, self.sx, self.sy = d * self.sw + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def __call__(self, x: float) -> float:
        var = self.sw * self.sxx - self.sx**2
        b = (self.sw * self.sxy - self.sx * self.sy) / var if var > 1e-12 else 0.0
        b = max(b, 0.0)  # more tokens never cost less
        a = (self.sy - b * self.sx) / self.sw
        return max(a + b * x, 1e-6)


class DraftCost:
    """Seconds per draft call for K draft steps over B sequences. Choices price it by a line in
    K x B (per sequence-step: this CPU's case, and the cautious one). Probes price it by
    a + b K + c K B, a fixed part (the call, batch set-up), a part per step and a part per
    sequence-step, fitted by exponentially weighted least squares (b, c >= 0) once calls at two
    batch sizes tell b from c, and until then as the per-step case: on a GPU a small draft model
    is launch-bound and a step costs about the same for 1 sequence or 16, and a line learned from
    1-user calls priced a 16-user call on the lent H200 at many times its cost, so the probe that
    would show otherwise never paid (session 13). Why choices keep the line: in Serve on this CPU
    the fit (rightly) found a draft call for 4 sequences no dearer than for 1 (the call is mostly
    RPC), and K=1 for all at 4 users then looked like a 3-10 % gain; made for 39 rounds, it lost
    7 % against K=0 (one run; session 13)."""

    def __init__(self, a: float, c: float, decay: float = 0.97, min_batch_spread: float = 0.5):
        self.line = LinearFit(a, c, decay)  # seconds vs K x B
        self.decay = decay
        self.min_batch_spread = min_batch_spread  # weighted std of B the calls must show before b and c are told apart
        self.sff = [[0.0] * 3 for _ in range(3)]  # weighted sums of f f^T, f = (1, K, K B)
        self.sfy = [0.0] * 3
        self.sb = self.sbb = 0.0  # weighted sums of B and B^2
        self._coef: tuple[float, float, float] | None = None
        self._stale = False  # solved on demand: only probes read the fit, drafting rounds observe every call

    def observe(self, batch: int, k: int, y: float) -> None:
        self.line.observe(k * batch, y)
        d, f = self.decay, (1.0, float(k), float(k * batch))
        for i in range(3):
            self.sfy[i] = d * self.sfy[i] + f[i] * y
            for j in range(3):
                self.sff[i][j] = d * self.sff[i][j] + f[i] * f[j]
        self.sb, self.sbb = d * self.sb + batch, d * self.sbb + batch * batch
        self._stale = True

    @property
    def coef(self) -> tuple[float, float, float] | None:
        """(a, b, c), or None while the calls seen do not tell b from c."""
        if self._stale:
            self._coef, self._stale = self._solve(), False
        return self._coef

    def _solve(self) -> tuple[float, float, float] | None:
        w = self.sff[0][0]
        if self.sbb / w - (self.sb / w) ** 2 < self.min_batch_spread ** 2:
            return None
        best, best_err = None, None
        for keep in ((0, 1, 2), (0, 1), (0, 2), (0,)):  # b, c >= 0: the best fit among the feasible subsets
            m = np.array([[self.sff[i][j] for j in keep] for i in keep])
            if np.linalg.cond(m) > 1e9:  # e.g. calls at only two (K, B) points: three terms are not determined
                continue
            sol = np.linalg.solve(m, np.array([self.sfy[i] for i in keep]))
            theta = [0.0, 0.0, 0.0]
            for i, v in zip(keep, sol):
                theta[i] = float(v)
            if theta[1] < 0 or theta[2] < 0:
                continue
            # weighted squared error up to a constant: theta' S theta - 2 theta' r
            err = sum(theta[i] * self.sff[i][j] * theta[j] for i in range(3) for j in range(3)) \
                - 2 * sum(t * r for t, r in zip(theta, self.sfy))
            if best_err is None or err < best_err:
                best, best_err = tuple(theta), err
        return best

    def optimistic(self, batch: int, k: int) -> float:
        """For deciding a probe: the fit, or while b and c are not told apart, a call over many
        sequences priced like one over a single sequence (the launch-bound case), so that the
        probe that would show the difference is made where it could pay."""
        if (coef := self.coef) is None:
            return self.line(k)
        a, b, c = coef
        return max(a + b * k + c * k * batch, 1e-6)

    def __call__(self, batch: int, k: int) -> float:
        """For choosing K: the line in K x B."""
        return self.line(k * batch)


class CostCurve:
    """Seconds per pass vs tokens in the pass, learned online: an EMA at every size seen, linear
    in between. Outside the sizes seen, the prior's shape is scaled to the nearest measurement
    (a prior that says extra tokens cost something keeps unexplored big passes from looking free)."""

    def __init__(self, a: float, b: float, new_weight: float = 0.3):
        self.prior_a, self.prior_b = a, b
        self.new_weight = new_weight  # EMA weight of a new measurement at its size
        self.points: dict[int, float] = {}

    def prior(self, x: float) -> float:
        return self.prior_a + self.prior_b * x

    def observe(self, x: int, y: float) -> None:
        old = self.points.get(x)
        self.points[x] = y if old is None else old + self.new_weight * (y - old)

    def __call__(self, x: int, optimistic: bool = False) -> float:
        """optimistic: past the biggest size seen, the line through the two biggest (flat if one),
        not the prior's shape: what a probe may hope for."""
        if x in self.points:
            return self.points[x]
        if not self.points:
            return self.prior(x)
        lo = max((p for p in self.points if p < x), default=None)
        hi = min((p for p in self.points if p > x), default=None)
        if lo is not None and hi is not None:
            w = (x - lo) / (hi - lo)
            return (1 - w) * self.points[lo] + w * self.points[hi]
        if hi is None and optimistic:  # the slope of the two biggest sizes seen, else flat
            top = sorted(self.points)[-2:]
            slope = (self.points[top[-1]] - self.points[top[0]]) / (top[-1] - top[0]) if len(top) == 2 else 0.0
            return self.points[lo] + max(slope, 0.0) * (x - lo)
        near = lo if lo is not None else hi
        return self.points[near] * self.prior(x) / self.prior(near)


@dataclass
class Acceptance:
    """Running acceptance of one kind of draft, overall and per draft position; it forgets per
    drafted token, so long stretches at K = 0 do not drift it back to the prior."""

    k_max: int  # draft positions tracked
    prior: float = 0.5  # acceptance assumed before any draft was verified
    prior_weight: float = 4.0  # pseudo-drafts behind the prior in each sequence's estimate
    decay: float = 0.995  # per drafted token: how fast the estimate forgets
    drafted: float = 0.0
    accepted: float = 0.0
    tried: list[float] = field(default_factory=list)  # per draft position: drafts that were reached
    hit: list[float] = field(default_factory=list)  # per draft position: drafts accepted

    def __post_init__(self):
        self.tried, self.hit = [0.0] * self.k_max, [0.0] * self.k_max

    def overall(self) -> float:
        return (self.accepted + self.prior * 8) / (self.drafted + 8)

    def positions(self) -> list[float]:
        """a_1..a_k_max; a position with little data leans on the one before it."""
        out, prev = [], self.overall()
        for tried, hit in zip(self.tried, self.hit):
            prev = (hit + prev * self.prior_weight) / (tried + self.prior_weight)
            out.append(prev)
        return out

    def of_sequence(self, num_accepted: int, num_drafted: int, towards: float | None = None) -> float:
        """A sequence's estimate, shrunk towards `towards` (default: the overall one) while it has
        few drafts."""
        base = self.overall() if towards is None else towards
        return (num_accepted + base * self.prior_weight) / (num_drafted + self.prior_weight)

    def gains(self, seq_acceptance: float) -> list[float]:
        """E(k) for k = 0..k_max: the positions' acceptances scaled by the sequence's record."""
        g, e, p = self.overall(), [1.0], 1.0
        for ai in self.positions():
            p *= min(ai * seq_acceptance / g, 0.999)
            e.append(e[-1] + p)
        return e

    def observe(self, drafted_accepted: list[tuple[int, int]]) -> None:
        num_drafted = sum(k for k, _ in drafted_accepted)
        d = self.decay ** num_drafted
        self.drafted = d * self.drafted + num_drafted
        self.accepted = d * self.accepted + sum(n for _, n in drafted_accepted)
        self.tried = [d * t for t in self.tried]
        self.hit = [d * h for h in self.hit]
        for k, n in drafted_accepted:
            for i in range(min(n + 1, k, self.k_max)):  # positions up to the first rejection were reached
                self.tried[i] += 1
                self.hit[i] += i < n


@dataclass
class AdaptiveK:
    k_max: int = 8  # largest K considered
    probe_every: int = 16  # rounds at K = 0 before the first probe; doubles after each failed probe
    max_probe_every: int = 256  # longest wait between probes
    min_gain: float = 0.03  # speculate only when predicted to beat K = 0 by this much (the model errs)
    first_probe_k: int = 2  # drafts in each new request's one probe (0 = no per-request probe)
    probe_optimism: float = 0.9  # a probe is made only if it would pay at this acceptance (else it can only lose)
    plain_refresh_every: int = 64  # rounds of speculation at a batch size before one plain round re-measures its plain pass
    slow_start: bool = False  # a sequence's model K at most twice what it last had accepted (first_probe_k at first)
    ride_along: bool = True  # with multi-step calls, a probe's drafts go in a plain call's first pass (see last_probe)
    multi_step: bool = False  # plain rounds run several steps per verifier call (set by who drives the rounds: Serve's decode_steps > 1)
    probe_min_room: int = 16  # a request's own probe only while it may emit this many more tokens (else too late to use)
    prior_acceptance: float = 0.5  # acceptance assumed before any draft was verified
    prior_weight: float = 4.0  # pseudo-drafts behind the prior in each sequence's estimate
    verify_prior: tuple[float, float] = (0.06, 0.01)  # s per verifier pass = a + b * tokens, until measured
    ema_decay: float = 0.995  # per drafted token: how fast the global acceptance estimate forgets
    calibration_weight: float = 30.0  # pseudo accepted drafts, predicted as they came, behind each batch size's calibration
    calibration_decay: float = 0.97  # per drafting round: how fast a batch size's calibration forgets
    draft_cost: DraftCost = field(default_factory=lambda: DraftCost(0.002, 0.0015))  # s per draft call vs K and batch
    _rounds_at_zero: int = 0
    _probe_wait: int = 0  # current rounds between probes (0 = probe_every)
    _probing: bool = False  # the last choice was a forced probe
    # one cost curve per batch size: the same tokens cost more spread over more sequences
    # (padding, masks), so a curve learned at 1 user would mislead at 4
    _verify_by_batch: dict[int, CostCurve] = field(default_factory=dict)
    # per batch size: seconds per pass of a multi-step plain call, an EMA (the curves above learn
    # from one-pass calls only: a speculative round is one pass, and pays a whole call)
    _multi_step_pass: dict[int, float] = field(default_factory=dict)
    # per batch size: the round (counted in choices) its plain pass was last measured at. A plain
    # cost measured while the machine was busy (another job, a noisy neighbour) makes speculating
    # every round look like a gain, and then nothing measures it again: seen in session 17 with a
    # CPU-bound job beside a serve_load run, 16 users drafted in 147 of 239 rounds at 0.93x K=0
    _plain_seen: dict[int, int] = field(default_factory=dict)
    _choices: int = 0
    # per batch size: model drafts' accepted count as predicted (uncalibrated) and as verified,
    # summed over drafting rounds with decay (see calibration)
    _calibration: dict[int, tuple[float, float]] = field(default_factory=dict)
    last_prediction: dict | None = None  # the last choice's expected tokens and rates (None: not priced)
    # the last choice was a probe (made to learn, not because it pays): with ride_along and
    # multi-step calls it rides along a plain call (its drafts in the call's first pass, then the
    # plain steps for all), so it costs its own rows and draft call, not every sequence's steps but one
    last_probe: bool = False

    def __post_init__(self):
        acc = lambda: Acceptance(self.k_max, self.prior_acceptance, self.prior_weight, self.ema_decay)  # noqa: E731
        self.model = acc()  # drafts of the model proposer (draft head / draft model)
        self.lookup = acc()  # drafts copied by prompt lookup: free to make, accepted very unevenly
        # model drafts in each sequence's first drafting round: what a request with no record of
        # its own may expect. `model` weights requests by how much they drafted, and adaptive K
        # drafts most where acceptance is best, so it overstates a new request's prospects
        self.first = acc()

    def verify_cost(self, batch: int, tokens: int, optimistic: bool = False) -> float:
        """optimistic: a pass longer than any measured at its batch size costs what the longest
        ones' slope says (for deciding a probe: on a GPU the curve stays flat far past where this
        CPU's rises, and priced by the prior's CPU-like slope, the probe that would show it never
        paid)."""
        curve = self._verify_by_batch.get(batch)
        if curve is None:  # a batch size not seen yet: the nearest one seen, scaled
            if not self._verify_by_batch:
                return self.verify_prior[0] + self.verify_prior[1] * tokens
            near = min(self._verify_by_batch, key=lambda b: abs(b - batch))
            # scaled as the two sizes' plain passes compare, where both were measured, not by the
            # batch ratio (session 12: one-pass calls at 3 and 14 users guessed from 4 and 16 by
            # the ratio came out near those sizes' measured plain passes, so probes there looked
            # free; measured, such calls cost 1.2-1.6 plain passes)
            plain, plain_near = self._multi_step_pass.get(batch), self._multi_step_pass.get(near)
            scale = plain / plain_near if plain and plain_near else batch / near
            cost = self._verify_by_batch[near](round(tokens * near / batch), optimistic) * scale
            if batch > near and tokens > batch:
                # bigger than any batch measured: it may be compute-bound, where a draft token
                # costs as much as a sequence's own (a small batch's flat curve says nothing of it)
                cost = max(cost, self.verify_cost(batch, batch) * tokens / batch)
            return cost
        return curve(tokens, optimistic)

    def _plain_pass_cost(self, batch: int) -> float | None:
        """Seconds per pass of a multi-step plain call at this batch size (None: no such calls).
        A size never decoded plainly is estimated from the sizes that were, linearly in the batch
        size: were it taken from the one-pass curve instead, a plain pass would be charged a whole
        call's overhead, speculation would look better than it is, and, speculating every round,
        the batch would never show what a plain pass costs."""
        ms = self._multi_step_pass
        if batch in ms or not ms:
            return ms.get(batch)
        lo = sorted((b for b in ms if b < batch), reverse=True)
        hi = sorted(b for b in ms if b > batch)
        if len(ms) == 1:
            near = next(iter(ms))
            return ms[near] * self.verify_cost(batch, batch) / self.verify_cost(near, near)
        a, b = (lo[0], hi[0]) if lo and hi else ((lo[1], lo[0]) if lo else (hi[0], hi[1]))
        slope = max((ms[b] - ms[a]) / (b - a), 0.0)
        return max(ms[a] + slope * (batch - a), 1e-6)

    def _unmeasured(self, batch: int) -> bool:
        """Bigger than every batch size a speculative pass was measured at: only a probe can tell."""
        return bool(self._verify_by_batch) and batch > max(self._verify_by_batch)

    def model_cap(self, last_accepted: int) -> int:
        """Most model drafts worth a sequence's round, given how many its last model-drafted
        round had accepted (-1: none yet). Deep positions' acceptance is learned mostly from the
        sequences that reach them, the ones that accept best; scaled down to a new chat request's
        level it still looked worth K = 7-8 drafts (session 12), and such rounds emitted 1-2 tokens
        at twice a plain step's cost. Doubling from first_probe_k, as the drafts keep being
        accepted, reaches k_max in two rounds where the prompt is that predictable. Off by
        default: in Serve at 1 user (16 questions each way) it was level with it off (speculation
        vs K=0 0.98x and 0.985x) while drafting twice as many rounds, each showing less of a
        sequence's acceptance, and the new-request estimate (`acceptance`) had already removed
        most of the K = 7-8 openings."""
        if not self.slow_start:
            return self.k_max
        start = max(self.first_probe_k, 1)
        return start if last_accepted < 0 else max(start, 2 * last_accepted)

    def position_acceptance(self) -> list[float]:
        return self.model.positions()

    def global_acceptance(self) -> float:
        return self.model.overall()

    def acceptance(self, num_accepted: int, num_drafted: int) -> float:
        """A sequence's model-draft acceptance: its own record, shrunk towards what requests
        accept in their first drafting round (session 12: shrunk towards the overall estimate,
        ~0.65 after a well-accepted code answer, new chat requests at ~0.35 opened with K=7)."""
        return self.model.of_sequence(num_accepted, num_drafted, self.first.overall() if self.first.drafted else None)

    def calibration(self, batch: int) -> float:
        """What the model's drafts at this batch size accepted, over what was predicted of them,
        at most 1: the predicted accepted drafts of each choice are scaled by it. A choice drafts
        where its prediction is high, so its errors there lean one way; and a request's record,
        made at this load's small K, is read against an overall rate that deep drafting elsewhere
        pulls down (session 18, Serve at 4 users: K = 3 for all four predicted 4.3-7.8 accepted
        drafts a round, 0-5 came, and the level ran 0.945x K=0). Only ever down: a prediction
        too low costs a gain that probes keep looking for, one too high costs rounds that lose.
        Not at one sequence: pooled over requests that differ (some accept well, most not), it
        marked the good ones down for the others' misses and cost a GPU-shaped simulation its
        1-user gain (bench/results/session18/README.md)."""
        if batch < 2:
            return 1.0
        p, r = self._calibration.get(batch, (0.0, 0.0))
        return min(1.0, (r + self.calibration_weight) / (p + self.calibration_weight))

    def choose(self, acceptances: list[float], budgets: list[int], new: list[bool] | None = None,
               lookups: list[int] | None = None, lookup_acceptances: list[float] | None = None,
               prefilling: bool = False) -> list[int]:
        """K per sequence (each capped by its budget): one K for the model proposer's sequences
        and one for those with a prompt-lookup match, chosen together since they share the
        verifier pass. budgets[i] = most drafts sequence i can use this round; new[i]: it has had
        no model draft verified yet; lookups[i] = length of its lookup match (0 = none), with its
        lookup acceptance estimate in lookup_acceptances[i]. prefilling: the pass also prefills a
        new sequence's prompt; no probe is forced into it (its cost, the prompt's, teaches nothing),
        and with multi-step calls nothing drafts in it (a draft there cuts every sequence's plain
        steps to one)."""
        B = len(acceptances)
        self.last_prediction, self.last_probe = None, False
        self._choices += 1
        multi_step = self.multi_step or bool(self._multi_step_pass)
        if multi_step and B not in self._multi_step_pass:
            # plain rounds run several steps per call, but never yet at this batch size: decode
            # plainly once to measure it, probes included. Its estimate from other sizes errs both
            # ways: linear from 1-4 users it put 16 users' plain pass at 0.17 s against 0.12
            # measured, and K=1 for all sixteen (or each new request's probe in turn) looked like
            # a gain; speculating every round, the batch never showed otherwise (session 12: 18
            # such rounds in one rep, 0.83x K=0; 16 probe rounds in another, 0.89x). With no
            # size measured yet (a fresh server), a plain round was priced as a one-pass call:
            # the README's first request drafted K=2 in every round at 23.5 tok/s, believing
            # plain decoding 17 tok/s; it was 26.6 (session 21)
            return [0] * B
        if prefilling and multi_step:
            # with multi-step calls any draft in a pass that prefills cuts every sequence's plain
            # steps to one, the new prompts' included, and such a pass is not costed, so no
            # choice here can be priced (session 16: one sequence's K=8 in a 4-user round that
            # prefilled three prompts: 4 tokens out of the call where plainly 16 came)
            return [0] * B
        lookups = lookups or [0] * B
        lk = [m > 0 for m in lookups]
        caps = [min(b, m) if m else b for b, m in zip(budgets, lookups)]
        raw = [self.lookup.gains(la) if m else self.model.gains(a)
               for a, m, la in zip(acceptances, lookups, lookup_acceptances or acceptances)]
        cal = self.calibration(B)
        gains = [e if m else [1 + cal * (x - 1) for x in e] for e, m in zip(raw, lk)]

        def ks_for(k: int, kl: int) -> list[int]:
            return [min(kl if m else k, c) for m, c in zip(lk, caps)]

        def rate_of(ks: list[int], gain_rows: list[list[float]], optimistic: bool = False) -> float:
            tokens = sum(e[ki] for e, ki in zip(gain_rows, ks))
            k_model = max((ki for ki, m in zip(ks, lk) if not m), default=0)
            n_drafting = sum(1 for ki, m in zip(ks, lk) if ki and not m)
            if not any(ks) and (plain := self._plain_pass_cost(B)) is not None:
                return tokens / plain
            draft_cost = self.draft_cost.optimistic if optimistic else self.draft_cost
            t = self.verify_cost(B, sum(ks) + B, optimistic) + (draft_cost(n_drafting, k_model) if k_model else 0.0)
            return tokens / t

        @functools.cache  # evaluated for every (k, kl) pair, then again for the checks below
        def rate(k: int, kl: int) -> float:
            return rate_of(ks_for(k, kl), gains)

        def probe_pays(probed: list[bool], k_probe: int) -> bool:
            """Could speculation pay for the probed sequences at some K if their drafts were
            accepted at probe_optimism? In a big batch the pass is compute-bound and every
            sequence waits for the draft call: then a probe can only lose, whatever it finds.
            Costs are the learned ones at every K, or, at the probe's own K, read hopefully
            where unmeasured: the probe measures exactly those, so the hope is tested once (hope
            at a deeper K, which the probe would not measure, would justify every later probe)."""
            opt = [sum(self.probe_optimism ** i for i in range(k + 1)) for k in range(self.k_max + 1)]  # E(k)
            rows, others = [opt if p else g for p, g in zip(probed, gains)], ks_for(0, best_l)
            bar = (1 + self.min_gain) * rate(0, best_l)

            def pays(k: int, optimistic: bool = False) -> bool:
                ks = [min(k, c) if p else o for p, c, o in zip(probed, caps, others)]
                return rate_of(ks, rows, optimistic) >= bar

            return pays(k_probe, optimistic=True) or any(pays(k) for k in range(1, limit + 1))

        limit = min(self.k_max, max((c for c, m in zip(caps, lk) if not m), default=0))
        limit_l = min(self.k_max, max((c for c, m in zip(caps, lk) if m), default=0))
        base = rate(0, 0)

        def chosen(ks: list[int]) -> list[int]:
            """Keep what the model expected of this choice and of K = 0 (for round traces: where
            its predictions and what rounds did part)."""
            self.last_prediction = {"tokens": round(sum(e[k] for e, k in zip(gains, ks)), 3),
                                    "tokens_per_s": round(rate_of(ks, gains), 2), "k0_tokens_per_s": round(base, 2),
                                    "model_accepted_raw": round(sum(e[k] - 1 for e, k, m in zip(raw, ks, lk) if not m), 3),
                                    "calibration": round(cal, 3)}
            return ks

        best, best_l = max(((k, kl) for k in range(limit + 1) for kl in range(limit_l + 1)), key=lambda x: rate(*x))
        if (best or best_l) and rate(best, best_l) < (1 + self.min_gain) * base:
            best, best_l = 0, 0
        if best_l and best and rate(0, best_l) >= (1 + self.min_gain) * base and \
                rate(best, best_l) < (1 + self.min_gain) * rate(0, best_l):
            best = 0  # the model's drafts must pay on their own, beyond what lookup already gains
        if self._probing:  # the last round was a probe: did it change the verdict?
            self._probe_wait = 0 if best > 0 else min(2 * (self._probe_wait or self.probe_every), self.max_probe_every)
        self._probing = False
        if (best or best_l) and B in self._multi_step_pass and not prefilling and \
                self._choices - self._plain_seen.get(B, 0) > self.plain_refresh_every:
            # speculating for long on a plain cost measured long ago: decode plainly once to
            # measure it again (a measurement that old replaces the stale one, see observe_verify)
            return chosen([0] * B)
        if best == 0 and new and self.first_probe_k and not prefilling and any(n and b and not m for n, b, m in zip(new, caps, lk)):
            # a request's own probe: its prompt may accept far above the average. Whether probing
            # is worth it is asked of one request: users who arrive together would otherwise be
            # judged on the optimistic gain of all of them at once (every one accepting at
            # probe_optimism), which pays for a pass over all their drafts that, at their real
            # acceptance, holds the whole batch up
            cands = [i for i, (n, c, m) in enumerate(zip(new, caps, lk)) if n and c and not m]
            others = ks_for(0, best_l)

            def probing(group: set[int]) -> list[int]:
                return [min(self.first_probe_k, caps[i]) if i in group else o for i, o in enumerate(others)]

            one = probing({cands[0]})
            if self._unmeasured(B):
                self.last_probe = True
                return chosen(one)
            if probe_pays([i == cands[0] for i in range(B)], self.first_probe_k):
                # every new request is then probed in turn; in one round together they share a
                # call, a draft call and a pass, where one at a time each pays a one-pass call
                # in place of its share of a multi-step one (session 17, Serve at 4 users: four
                # lone probes a rep, each ~20 ms dearer than the plain tokens it gave, ~3 % of a
                # rep). They go together when that costs less than the lone probes would in all
                def loss(ks: list[int]) -> float:
                    """Seconds beyond plain decoding of the tokens the round is expected to give."""
                    tokens = sum(e[k] for e, k in zip(gains, ks))
                    return tokens / rate_of(ks, gains) - tokens / rate(0, best_l)

                together = probing(set(cands))
                self.last_probe = True
                if len(cands) > 1 and loss(together) < len(cands) * loss(one):
                    return chosen(together)
                return chosen(one)
        if best == 0 and limit > 0:
            self._rounds_at_zero += 1
            if self._rounds_at_zero >= (self._probe_wait or self.probe_every) and not prefilling and \
                    (self._unmeasured(B) or probe_pays([not m for m in lk], 1)):  # else: probe once the load allows
                self._rounds_at_zero, best, self._probing, self.last_probe = 0, 1, True, True
        else:
            self._rounds_at_zero = 0
        return chosen(ks_for(best, best_l))

    def state(self) -> dict:
        """What the choices rest on, for operators: costs learned and acceptance per position."""
        return {"verify_s_by_batch": {b: {t: round(y, 4) for t, y in sorted(c.points.items())}
                                      for b, c in sorted(self._verify_by_batch.items())},
                "multi_step_pass_s": {b: round(y, 4) for b, y in sorted(self._multi_step_pass.items())},
                "draft_s_per_call": {f"K={k} B={b}": round(self.draft_cost(b, k), 4)
                                     for k, b in ((1, 1), (4, 1), (1, 16), (4, 16))},
                "model_acceptance_by_position": [round(a, 3) for a in self.model.positions()],
                "first_round_acceptance": round(self.first.overall(), 3),
                "calibration_by_batch": {b: round(self.calibration(b), 3) for b in sorted(self._calibration)},
                "lookup_acceptance_by_position": [round(a, 3) for a in self.lookup.positions()]}

    def observe_round(self, drafted_accepted: list[tuple[int, int]], looked_up: list[bool] | None = None,
                      first: list[bool] | None = None, predicted: dict | None = None) -> None:
        """(drafts, accepted) of each sequence in a verified round; looked_up[i]: its drafts came
        from prompt lookup; first[i]: its sequence had no model drafts before this round;
        predicted: what the choice of this round expected (its last_prediction). Running
        estimates of what the verifier accepted, not preset rates."""
        looked_up = looked_up or [False] * len(drafted_accepted)
        first = first or [False] * len(drafted_accepted)
        model = [x for x, m in zip(drafted_accepted, looked_up) if not m]
        if any(k for k, _ in model) and predicted and "model_accepted_raw" in predicted:
            b, d = len(drafted_accepted), self.calibration_decay
            p, r = self._calibration.get(b, (0.0, 0.0))
            self._calibration[b] = (d * p + predicted["model_accepted_raw"], d * r + sum(n for _, n in model))
        self.model.observe(model)
        self.first.observe([x for x, m, f in zip(drafted_accepted, looked_up, first) if f and not m and x[0]])
        self.lookup.observe([x for x, m in zip(drafted_accepted, looked_up) if m])

    def observe_verify(self, batch: int, tokens_in_pass: int, seconds: float, steps: int = 1) -> None:
        """seconds per pass of a call that made `steps` passes (steps > 1: plain decoding steps)."""
        if steps > 1:
            old = self._multi_step_pass.get(batch)
            stale = self._choices - self._plain_seen.get(batch, 0) >= self.plain_refresh_every
            self._multi_step_pass[batch] = seconds if old is None or stale else old + 0.3 * (seconds - old)
            self._plain_seen[batch] = self._choices
            return
        if batch not in self._verify_by_batch:
            self._verify_by_batch[batch] = CostCurve(*self.verify_prior)
        self._verify_by_batch[batch].observe(tokens_in_pass, seconds)

    def observe_draft(self, batch: int, steps: int, seconds: float) -> None:
        if steps:
            self.draft_cost.observe(batch, steps, seconds)
