"""Adaptive speculation: pick K each round to maximise expected tokens per second.

With per-draft acceptance a (assumed independent per position), K drafts yield on average
E(K) = (1 - a^(K+1)) / (1 - a) tokens per verifier pass. A round costs the draft steps plus one
verifier pass over all the batch's tokens, both measured online as linear fits (so the cost
curve of the machine, and the growth of verify cost with load, are what decide). K = 0 is
chosen whenever speculation would not pay; a probe round now and then keeps the acceptance
estimate fresh so speculation can come back."""
from __future__ import annotations

from dataclasses import dataclass, field


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


def expected_tokens(a: float, k: int) -> float:
    a = min(max(a, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


@dataclass
class AdaptiveK:
    k_max: int = 8  # largest K considered
    probe_every: int = 16  # rounds between forced probes while K = 0 is chosen
    prior_acceptance: float = 0.5  # acceptance assumed before any draft was verified
    prior_weight: float = 4.0  # pseudo-drafts behind the prior in each sequence's estimate
    verify_cost: LinearFit = field(default_factory=lambda: LinearFit(0.06, 0.01))  # s vs tokens in pass
    ema_decay: float = 0.99  # per round: how fast the global acceptance estimate forgets
    draft_cost: LinearFit = field(default_factory=lambda: LinearFit(0.005, 0.001))  # s per draft step vs batch
    _drafted: float = 0.0
    _accepted: float = 0.0
    _rounds_at_zero: int = 0

    def global_acceptance(self) -> float:
        return (self._accepted + self.prior_acceptance * 8) / (self._drafted + 8)

    def acceptance(self, num_accepted: int, num_drafted: int) -> float:
        """A sequence's estimate, shrunk towards the global one while it has few drafts."""
        g = self.global_acceptance()
        return (num_accepted + g * self.prior_weight) / (num_drafted + self.prior_weight)

    def choose(self, acceptances: list[float], budgets: list[int]) -> list[int]:
        """One K for the batch (each capped by its sequence's budget); budgets[i] = most drafts
        sequence i can use this round."""
        B = len(acceptances)

        def rate(k: int) -> float:
            ks = [min(k, b) for b in budgets]
            tokens = sum(expected_tokens(a, ki) for a, ki in zip(acceptances, ks))
            t = self.verify_cost(sum(ks) + B) + (self.draft_cost(B) * max(ks) if k else 0.0)
            return tokens / t

        limit = min(self.k_max, max(budgets, default=0))
        best = max(range(limit + 1), key=rate)
        if best == 0 and limit > 0:
            self._rounds_at_zero += 1
            if self._rounds_at_zero >= self.probe_every:
                self._rounds_at_zero, best = 0, 1
        else:
            self._rounds_at_zero = 0
        return [min(best, b) for b in budgets]

    def observe_round(self, num_drafted: int, num_accepted: int) -> None:
        d = self.ema_decay  # running estimate of what the verifier accepted, not a preset rate
        self._drafted = d * self._drafted + num_drafted
        self._accepted = d * self._accepted + num_accepted

    def observe_verify(self, tokens_in_pass: int, seconds: float) -> None:
        self.verify_cost.observe(tokens_in_pass, seconds)

    def observe_draft(self, batch: int, steps: int, seconds: float) -> None:
        if steps:
            self.draft_cost.observe(batch, seconds / steps)
