"""What speculation did, per request and aggregated."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    num_prompt_tokens: int = 0  # tokens in the prompt
    num_output_tokens: int = 0  # tokens emitted
    num_drafted: int = 0  # draft tokens proposed
    num_draft_positions: int = 0  # positions drafted: a chain's drafts, a token tree's depth
    num_accepted: int = 0  # draft tokens the verifier accepted
    num_lookup_drafted: int = 0  # of num_drafted: copied by prompt lookup (the rest: the draft model)
    num_lookup_accepted: int = 0  # of num_accepted: lookup drafts accepted
    num_judged: int = 0  # positions the verifier reached: accepted ones and each round's first rejected one
    num_lookup_judged: int = 0  # of num_judged: in rounds of lookup drafts
    num_prediction_drafted: int = 0  # of num_lookup_drafted: copied from the request's prediction
    num_prediction_accepted: int = 0  # of num_lookup_accepted: those accepted
    num_prediction_judged: int = 0  # of num_lookup_judged: in rounds of the prediction's drafts
    num_verifier_passes: int = 0  # verify rounds this request took part in (= decoding steps)
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: rounds where draft j was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [j]: rounds that proposed a j-th draft
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    t_finish: float | None = None

    def record_round(self, num_drafted: int, num_accepted: int, num_passes: int = 1, lookup: bool = False,
                     positions: int | None = None, predicted: bool = False) -> None:
        """positions: the depth of a token tree (None: a chain, num_drafted deep); predicted: the
        lookup's copy came from the request's prediction."""
        positions = num_drafted if positions is None else positions
        judged = min(num_accepted + 1, positions)  # a draft after a rejected one says nothing of the draft
        self.num_verifier_passes += num_passes
        self.num_judged += judged
        self.num_drafted += num_drafted
        self.num_draft_positions += positions
        self.num_accepted += num_accepted
        if lookup:  # the drafts were copied by prompt lookup
            self.num_lookup_drafted += num_drafted
            self.num_lookup_accepted += num_accepted
            self.num_lookup_judged += judged
        if lookup and predicted:
            self.num_prediction_drafted += num_drafted
            self.num_prediction_accepted += num_accepted
            self.num_prediction_judged += judged
        for per, n in ((self.drafted_per_position, positions), (self.accepted_per_position, num_accepted)):
            per.extend([0] * (n - len(per)))
            for j in range(n):
                per[j] += 1

    @property
    def num_model_drafted(self) -> int:
        return self.num_drafted - self.num_lookup_drafted

    @property
    def num_model_judged(self) -> int:
        return self.num_judged - self.num_lookup_judged

    @property
    def num_model_accepted(self) -> int:
        return self.num_accepted - self.num_lookup_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifier pass: 1 (recovered or bonus) + accepted drafts."""
        return 1.0 + self.num_accepted / self.num_verifier_passes if self.num_verifier_passes else 0.0

    @property
    def latency_s(self) -> float:
        return ((self.t_finish or time.perf_counter()) - self.t_arrival)

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first_token is None else self.t_first_token - self.t_arrival

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.latency_s if self.latency_s > 0 else 0.0

    @property
    def ms_per_output_token(self) -> float:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if self.t_first_token is None or self.num_output_tokens < 2:
            return 0.0
        return 1000.0 * ((self.t_finish or time.perf_counter()) - self.t_first_token) / (self.num_output_tokens - 1)

    def to_dict(self) -> dict:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "num_lookup_drafted": self.num_lookup_drafted,
            "num_lookup_accepted": self.num_lookup_accepted,
            "num_prediction_drafted": self.num_prediction_drafted,
            "num_prediction_accepted": self.num_prediction_accepted,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "num_verifier_passes": self.num_verifier_passes,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "ms_per_output_token": round(self.ms_per_output_token, 3),
            "latency_s": round(self.latency_s, 4),
        }


def aggregate(ms: list[SpecMetrics]) -> dict:
    """Totals and token-weighted rates over many requests."""
    drafted = sum(m.num_drafted for m in ms)
    accepted = sum(m.num_accepted for m in ms)
    passes = sum(m.num_verifier_passes for m in ms)
    out_tokens = sum(m.num_output_tokens for m in ms)
    width = max((len(m.drafted_per_position) for m in ms), default=0)
    acc_pos = [sum(m.accepted_per_position[j] if j < len(m.accepted_per_position) else 0 for m in ms) for j in range(width)]
    dr_pos = [sum(m.drafted_per_position[j] if j < len(m.drafted_per_position) else 0 for m in ms) for j in range(width)]
    latency = sum(m.latency_s for m in ms)
    ttfts = [m.ttft_s for m in ms if m.ttft_s is not None]
    return {
        "num_requests": len(ms),
        "num_output_tokens": out_tokens,
        "num_drafted": drafted,
        "num_accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "num_lookup_drafted": sum(m.num_lookup_drafted for m in ms),
        "num_lookup_accepted": sum(m.num_lookup_accepted for m in ms),
        "num_prediction_drafted": sum(m.num_prediction_drafted for m in ms),
        "num_prediction_accepted": sum(m.num_prediction_accepted for m in ms),
        "mean_accepted_length": round(1 + accepted / passes, 4) if passes else 0.0,
        "acceptance_per_position": [round(a / d, 4) if d else 0.0 for a, d in zip(acc_pos, dr_pos)],
        "num_verifier_passes": passes,
        "verifier_passes_per_token": round(passes / out_tokens, 4) if out_tokens else 0.0,
        "tokens_per_s": round(out_tokens / latency, 3) if latency else 0.0,
        "mean_ttft_s": round(sum(ttfts) / len(ttfts), 4) if ttfts else None,
        "mean_latency_s": round(latency / len(ms), 4) if ms else 0.0,
    }
