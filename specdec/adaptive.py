"""Adaptive speculation: choose each round's drafts per sequence to maximise expected tokens/s.

Acceptance. With acceptance a_i at draft position i (given the drafts before it were accepted;
later guesses are worse), K drafts yield E(K) = 1 + a_1 + a_1 a_2 + ... + a_1...a_K tokens per
verifier pass. The a_i are learned over all sequences and scaled by a sequence's own record; a
request with no record is expected to do what requests did in their first drafting round (the
overall rate leans on the requests that drafted most, the ones that accept best). Prompt-lookup
copies are free to make and accepted very unevenly (near 1 in extractive answers, near 0
elsewhere), so they have their own acceptance and their own K. Above one sequence, the accepted
drafts a choice predicts are scaled down by how such predictions came in at that batch size.

Costs (specdec/adaptive_costs.py). A round is one verifier pass over the batch's tokens plus one
draft call, both measured online per batch size. Where plain rounds run several steps per call
(multi-step), a batch size decodes plainly until its plain pass is measured, and again once that
measurement is old.

Choice. The model's K and the lookup K are chosen together (they share the pass): the pair with
the most tokens/s, kept only if it beats K = 0 by min_gain. At K = 0, probes keep the estimates
fresh: each new request once (first_probe_k drafts; new requests together where that costs less)
and periodically, less and less often while probes find nothing. A probe is made only where it
would pay were its drafts accepted at PROBE_OPTIMISM, so a compute-bound batch waits for the load
to fall. No probe goes into a round that prefills a prompt (it is not costed), and with
multi-step calls nothing drafts there (a draft would cut every sequence's plain steps to one)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

from specdec.adaptive_costs import Costs
from specdec.confidence import Confidence

PROBE_EVERY, MAX_PROBE_EVERY = 16, 256  # rounds at K = 0 before a periodic probe: at first, at most
PROBE_OPTIMISM = 0.9  # a probe is made only if it would pay at this acceptance (else it can only lose)
ACCEPTANCE_PRIOR = 0.5  # the estimate's prior, before the verifier has judged any draft
PRIOR_WEIGHT = 4.0  # pseudo-drafts behind the prior in each sequence's and position's estimate
ACCEPTANCE_DECAY = 0.995  # per drafted token: how fast acceptance estimates forget
CALIBRATION_DECAY = 0.97  # per drafting round: how fast a batch size's calibration forgets


# ---- acceptance ----

class Acceptance:
    """Running acceptance of one kind of draft, overall and per draft position. It forgets per
    drafted token, so long stretches at K = 0 do not drift it back to the prior."""

    def __init__(self, k_max: int):
        self.judged: float = 0.0  # drafts the verifier reached (up to each round's first rejection), decayed
        self.accepted: float = 0.0  # of those, accepted by the verifier, decayed
        self.tried, self.hit = [0.0] * k_max, [0.0] * k_max  # per position: drafts reached, accepted

    def overall(self) -> float:
        return (self.accepted + ACCEPTANCE_PRIOR * 8) / (self.judged + 8)

    def positions(self) -> list[float]:
        """a_1..a_k_max; a position with little data leans on the one before it."""
        out, prev = [], self.overall()
        for tried, hit in zip(self.tried, self.hit):
            prev = (hit + prev * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)
            out.append(prev)
        return out

    def of_sequence(self, num_accepted: int, num_judged: int, towards: float | None = None) -> float:
        """A sequence's estimate, shrunk towards `towards` (default: overall) while it has few
        drafts judged. A draft after a rejected one is not judged: counted, a probe of K drafts
        rejected at its first would mark its request down K times for one miss."""
        base = self.overall() if towards is None else towards
        return (num_accepted + base * PRIOR_WEIGHT) / (num_judged + PRIOR_WEIGHT)

    def gains(self, seq_acceptance: float) -> list[float]:
        """E(k) for k = 0..k_max: the positions' acceptances scaled by the sequence's record."""
        g, e, p = self.overall(), [1.0], 1.0
        for ai in self.positions():
            p *= min(ai * seq_acceptance / g, 0.999)
            e.append(e[-1] + p)
        return e

    def observe(self, drafted_accepted: list[tuple[int, int]]) -> None:
        num_judged = sum(min(n + 1, k) for k, n in drafted_accepted)
        d = ACCEPTANCE_DECAY ** num_judged
        self.judged = d * self.judged + num_judged
        self.accepted = d * self.accepted + sum(n for _, n in drafted_accepted)
        self.tried, self.hit = [d * t for t in self.tried], [d * h for h in self.hit]
        for k, n in drafted_accepted:
            for i in range(min(n + 1, k, len(self.tried))):  # positions up to the first rejection were reached
                self.tried[i] += 1
                self.hit[i] += i < n


# ---- the choice: pure functions of plain data ----

def round_rate(lookup: list[bool], costs: Costs, ks: list[int], rows: list[list[float]],
               optimistic: bool = False) -> float:
    """Expected tokens/s of a round drafting ks (rows[i][k]: E(k) of sequence i): a plain pass if
    nothing drafts, else a one-pass call plus a draft call for the model's drafts (lookup's are
    free). optimistic: costs nothing measured are read hopefully (for probes)."""
    tokens = sum(e[k] for e, k in zip(rows, ks))
    if not any(ks) and (plain := costs.plain.get(len(ks))) is not None:
        return tokens / plain
    k_model = n_drafting = 0  # the model's deepest K, and how many sequences it drafts for
    for k, m in zip(ks, lookup):
        if k and not m:
            k_model, n_drafting = max(k_model, k), n_drafting + 1
    draft = costs.draft.optimistic if optimistic else costs.draft
    seconds = costs.verify(len(ks), sum(ks) + len(ks), optimistic) + (draft(n_drafting, k_model) if k_model else 0.0)
    return tokens / seconds


@dataclass(frozen=True)
class Menu:
    """What one choice weighs: E(k) rows per sequence, their caps, which sequences draft by
    lookup, and rate(ks, rows, optimistic=False), a round's expected tokens/s."""

    rows: list[list[float]]
    caps: list[int]
    lookup: list[bool]
    rate: Callable[..., float]

    def ks(self, k: int, kl: int) -> list[int]:
        """K for the model's sequences, kl for lookup's, each within its cap."""
        return [min(kl if m else k, c) for m, c in zip(self.lookup, self.caps)]

    def limit(self, lookup: bool, k_max: int) -> int:
        """The deepest K worth weighing for the lookup (or the model's) sequences."""
        return min(k_max, max((c for c, m in zip(self.caps, self.lookup) if m == lookup), default=0))


def best_pair(rates: dict[tuple[int, int], float], min_gain: float) -> tuple[int, int]:
    """The fastest (K, lookup K) if it beats K = 0 by min_gain; the model's drafts must also pay
    beyond what the lookup drafts alone gain."""
    k, kl = max(rates, key=rates.get)
    if (k or kl) and rates[k, kl] < (1 + min_gain) * rates[0, 0]:
        return 0, 0
    if kl and k and rates[0, kl] >= (1 + min_gain) * rates[0, 0] and rates[k, kl] < (1 + min_gain) * rates[0, kl]:
        return 0, kl
    return k, kl


def probe_pays(menu: Menu, probed: list[bool], k_probe: int, others: list[int], bar: float, limit: int) -> bool:
    """Would drafting beat `bar` for the probed sequences at some K, were their drafts accepted at
    PROBE_OPTIMISM (the others drafting `others`)? In a compute-bound batch it cannot. Costs are
    read hopefully only at the probe's own K: what the probe measures (hope at a deeper K, which
    it would not measure, would justify every later probe)."""
    hope = [sum(PROBE_OPTIMISM ** i for i in range(k + 1)) for k in range(len(menu.rows[0]))]
    rows = [hope if p else e for p, e in zip(probed, menu.rows)]

    def pays(k: int, optimistic: bool = False) -> bool:
        ks = [min(k, c) if p else o for p, c, o in zip(probed, menu.caps, others)]
        return menu.rate(ks, rows, optimistic) >= bar

    return pays(k_probe, optimistic=True) or any(pays(k) for k in range(1, limit + 1))


def request_probe(menu: Menu, new: list[bool], k_probe: int, others: list[int], bar: float, limit: int,
                  unmeasured: bool) -> list[int] | None:
    """ks probing new requests (a prompt may accept far above the average), or None. Whether it
    pays is asked of one request: all of them accepting well at once would justify a pass that,
    at their real acceptance, holds the batch up. Then they share one probe round where that costs
    less than a round each."""
    cands = [i for i, (n, c, m) in enumerate(zip(new, menu.caps, menu.lookup)) if n and c and not m]
    if not cands or not k_probe:
        return None

    def probing(group: set[int]) -> list[int]:
        return [min(k_probe, menu.caps[i]) if i in group else o for i, o in enumerate(others)]

    def loss(ks: list[int]) -> float:
        """Seconds beyond plain decoding of the tokens the round is expected to give."""
        tokens = sum(e[k] for e, k in zip(menu.rows, ks))
        return tokens / menu.rate(ks, menu.rows) - tokens / menu.rate(others, menu.rows)

    one = probing({cands[0]})
    if unmeasured:  # only a probe can tell what a pass at this batch size costs
        return one
    if not probe_pays(menu, [i == cands[0] for i in range(len(others))], k_probe, others, bar, limit):
        return None
    together = probing(set(cands))
    return together if len(cands) > 1 and loss(together) < len(cands) * loss(one) else one


@dataclass
class Backoff:
    """Periodic probes at K = 0: after PROBE_EVERY rounds, the wait doubling (to MAX_PROBE_EVERY)
    after each probe that leaves K at 0, back to PROBE_EVERY once one finds a gain."""

    wait: int = PROBE_EVERY
    idle: int = 0  # rounds at K = 0 since the last periodic probe
    probing: bool = False  # the last choice was a periodic probe

    def verdict(self, speculating: bool) -> None:
        """The choice after a periodic probe tells whether it found a gain."""
        if self.probing:
            self.wait = PROBE_EVERY if speculating else min(2 * self.wait, MAX_PROBE_EVERY)
        self.probing = False

    def due(self, at_zero: bool) -> bool:
        """Counts the rounds at K = 0; True when a probe is due."""
        self.idle = self.idle + 1 if at_zero else 0
        return at_zero and self.idle >= self.wait

    def start(self) -> None:
        self.idle, self.probing = 0, True


@dataclass
class AdaptiveK:
    """K per sequence each round, from what it learns of acceptance and costs (observe_*). Its
    arguments are the options a deployment may set (`adaptive_options`)."""

    k_max: int = 8  # largest K considered
    min_gain: float = 0.03  # speculate only when predicted to beat K = 0 by this much (the model errs)
    first_probe_k: int = 2  # drafts in each new request's one probe (0 = no per-request probe)
    probe_min_room: int = 16  # a request's own probe only while it may emit this many more tokens
    calibration_weight: float = 30.0  # pseudo-drafts, predicted as they came, behind each batch size's calibration
    # set by whoever drives the rounds: plain rounds run several decoding steps per verifier call
    multi_step: bool = field(default=False, init=False)
    last_prediction: dict | None = field(default=None, init=False)  # the last choice's expectations (None: unpriced)
    # the last choice was a probe: with multi-step calls it rides along a plain call (its drafts in
    # the first pass, then every sequence's plain steps)
    last_probe: bool = field(default=False, init=False)

    def __post_init__(self):
        self.model = Acceptance(self.k_max)  # the model proposer's drafts
        self.lookup = Acceptance(self.k_max)  # prompt-lookup copies
        self.first = Acceptance(self.k_max)  # model drafts in each sequence's first drafting round
        self.costs, self.backoff = Costs(), Backoff()
        self.confidence = Confidence()  # drafts' acceptance by their confidence (which drafts to verify)
        self._calibration: dict[int, tuple[float, float]] = {}  # batch -> (predicted, accepted) model drafts, decayed
        self._choices = 0

    def position_acceptance(self) -> list[float]:
        return self.model.positions()

    def global_acceptance(self) -> float:
        return self.model.overall()

    def acceptance(self, num_accepted: int, num_judged: int) -> float:
        """A sequence's model-draft acceptance: its record, shrunk towards what first rounds accept."""
        return self.model.of_sequence(num_accepted, num_judged, self.first.overall() if self.first.judged else None)

    def calibration(self, batch: int) -> float:
        """Accepted over predicted model drafts at this batch size, at most 1: a choice drafts where
        its prediction runs high, and a record made at a small K is read against an overall rate
        that deep drafting elsewhere pulls down. Not at one sequence: pooled over requests that
        differ, it would mark the good ones down for the others' misses."""
        if batch < 2:
            return 1.0
        p, r = self._calibration.get(batch, (0.0, 0.0))
        return min(1.0, (r + self.calibration_weight) / (p + self.calibration_weight))

    def choose(self, acceptances: list[float], budgets: list[int], new: list[bool] | None = None,
               lookups: list[int] | None = None, lookup_acceptances: list[float] | None = None,
               prefilling: bool = False) -> list[int]:
        """K per sequence, within budgets[i]. new[i]: no model draft verified yet; lookups[i]: its
        prompt-lookup match length (0: none), accepted at lookup_acceptances[i]; prefilling: the
        pass also prefills a prompt."""
        B = len(acceptances)
        self.last_prediction, self.last_probe = None, False
        self._choices += 1
        if (self.multi_step or self.costs.plain) and (B not in self.costs.plain or prefilling):
            # multi-step plain calls: a batch size decodes plainly until its plain pass is measured
            # (guessed, it can make drafting every round look like a gain that nothing checks), and
            # a pass that prefills gets no drafts (they would cut every sequence's plain steps to one)
            return [0] * B
        lookups = lookups or [0] * B
        lk = [m > 0 for m in lookups]
        raw = [self.lookup.gains(la) if x else self.model.gains(a)
               for a, x, la in zip(acceptances, lk, lookup_acceptances or acceptances)]
        cal = self.calibration(B)
        menu = Menu(rows=[e if x else [1 + cal * (g - 1) for g in e] for e, x in zip(raw, lk)],
                    caps=[min(b, m) if x else min(b, self.k_max) for b, m, x in zip(budgets, lookups, lk)],
                    lookup=lk, rate=functools.partial(round_rate, lk, self.costs))
        ks = self._pick(menu, new, prefilling)
        model_raw = sum(e[k] - 1 for e, k, x in zip(raw, ks, lk) if not x)
        self.last_prediction = {"tokens": round(sum(e[k] for e, k in zip(menu.rows, ks)), 3),
                                "tokens_per_s": round(menu.rate(ks, menu.rows), 2),
                                "k0_tokens_per_s": round(menu.rate([0] * B, menu.rows), 2),
                                "model_accepted_raw": round(model_raw, 3), "calibration": round(cal, 3)}
        return ks

    def _pick(self, menu: Menu, new: list[bool] | None, prefilling: bool) -> list[int]:
        """The fastest pair, or a plain round to re-measure an old plain pass, or a probe: a new
        request's, or a periodic one once due."""
        B, limit, limit_lookup = len(menu.caps), menu.limit(False, self.k_max), menu.limit(True, self.k_max)
        rates = {(k, kl): menu.rate(menu.ks(k, kl), menu.rows) for k in range(limit + 1) for kl in range(limit_lookup + 1)}
        k, kl = best_pair(rates, self.min_gain)
        self.backoff.verdict(k > 0)
        if (k or kl) and not prefilling and self.costs.plain_stale(B, self._choices):
            return [0] * B  # decode plainly once: the plain pass this speculation beats is old
        others, bar, unmeasured = menu.ks(0, kl), (1 + self.min_gain) * rates[0, kl], self.costs.unmeasured(B)
        if k == 0 and new and not prefilling:
            if (probe := request_probe(menu, new, self.first_probe_k, others, bar, limit, unmeasured)) is not None:
                self.last_probe = True
                return probe
        if self.backoff.due(at_zero=k == 0 and limit > 0) and not prefilling and \
                (unmeasured or probe_pays(menu, [not x for x in menu.lookup], 1, others, bar, limit)):
            self.backoff.start()
            self.last_probe, k = True, 1
        return menu.ks(k, kl)

    def state(self) -> dict:
        """What the choices rest on, for operators: costs learned and acceptance per position."""
        c = self.costs
        return {"verify_s_by_batch": {b: {t: round(y, 4) for t, y in sorted(curve.items())}
                                      for b, curve in sorted(c.curves.items())},
                "multi_step_pass_s": {b: round(y, 4) for b, y in sorted(c.plain.items())},
                "draft_s_per_call": {f"K={k} B={b}": round(c.draft(b, k), 4)
                                     for k, b in ((1, 1), (4, 1), (1, 16), (4, 16))},
                "model_acceptance_by_position": [round(a, 3) for a in self.model.positions()],
                "first_round_acceptance": round(self.first.overall(), 3),
                "calibration_by_batch": {b: round(self.calibration(b), 3) for b in sorted(self._calibration)},
                "lookup_acceptance_by_position": [round(a, 3) for a in self.lookup.positions()],
                "acceptance_by_confidence_decile": self.confidence.state()}

    def observe_round(self, drafted_accepted: list[tuple[int, int]], looked_up: list[bool] | None = None,
                      first: list[bool] | None = None, predicted: dict | None = None) -> None:
        """(drafts, accepted) per sequence of a verified round; looked_up[i]: its drafts were
        copied by lookup; first[i]: it had no model drafts before; predicted: the round's
        last_prediction (for the calibration)."""
        looked_up = looked_up or [False] * len(drafted_accepted)
        first = first or [False] * len(drafted_accepted)
        model = [x for x, m in zip(drafted_accepted, looked_up) if not m]
        if any(k for k, _ in model) and predicted and "model_accepted_raw" in predicted:
            b, d = len(drafted_accepted), CALIBRATION_DECAY
            p, r = self._calibration.get(b, (0.0, 0.0))
            self._calibration[b] = (d * p + predicted["model_accepted_raw"], d * r + sum(n for _, n in model))
        self.model.observe(model)
        self.first.observe([x for x, m, f in zip(drafted_accepted, looked_up, first) if f and not m and x[0]])
        self.lookup.observe([x for x, m in zip(drafted_accepted, looked_up) if m])

    def observe_verify(self, batch: int, tokens_in_pass: int, seconds: float, steps: int = 1) -> None:
        """seconds per pass of a call that made `steps` passes (steps > 1: plain decoding steps)."""
        self.costs.observe_verify(batch, tokens_in_pass, seconds, steps, self._choices)

    def observe_draft(self, batch: int, steps: int, seconds: float) -> None:
        if steps:
            self.costs.draft.observe(batch, steps, seconds)
