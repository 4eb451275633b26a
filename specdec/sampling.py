"""Sampling parameters and the logits -> probabilities transform shared by draft and verifier.

Speculative decoding is lossless only if the verifier's p is exactly the distribution plain
sampling would use, so temperature, top-k and top-p are applied here, once, for both p and q.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

import torch
from torch import Tensor


MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (vLLM's and OpenAI's chat limit)
# temperatures below this decode greedily (vLLM's _SAMPLING_EPS): logits / T overflows fp32 to inf
# for T under ~1e-37, and no sampled distribution that close to T = 0 differs from the argmax
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 128  # new tokens to generate at most
    temperature: float = 0.0  # < SAMPLING_EPS: greedy (argmax); otherwise softmax(logits / temperature)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # makes sampling reproducible; None draws one per request
    stop: list[str] = field(default_factory=list)  # stop strings: output ends before the first one
    stop_token_ids: list[int] = field(default_factory=list)  # extra end-of-sequence ids
    ignore_eos: bool = False  # keep going past EOS (benchmarks want fixed lengths)
    logprobs: int | None = None  # None: none; n >= 0: each output token's log-probability and its n likeliest alternatives

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError("temperature must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.seed is None:
            self.seed = random.getrandbits(63)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def logits_to_probs(logits: Tensor, p: SamplingParams) -> Tensor:
    """[N, V] logits -> [N, V] probabilities under temperature, top-k and top-p (fp32).

    Scaled in log space from each row's maximum: (logit - max) / T is 0 for the likeliest token
    and finite or -inf for the rest at any temperature, so no row ever holds inf - inf. A row
    with no finite logit (a broken model output) samples uniformly rather than failing the batch."""
    x = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    top = x.amax(dim=-1, keepdim=True)
    x = (x - torch.where(torch.isfinite(top), top, 0.0)) / max(p.temperature, SAMPLING_EPS)
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        probs = top_p_filter(probs, p.top_p)
    # elementwise, not `if broken.any()`: a host sync per call would stall a GPU verifier's pass
    return torch.where(torch.isfinite(probs).all(dim=-1, keepdim=True), probs, 1.0 / probs.shape[-1])


NUCLEUS_FIRST_TRY = 256  # top-p looks for the nucleus among this many likeliest tokens first


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of likeliest tokens whose mass reaches top_p, renormalised: a token is
    dropped when the mass strictly before it already reaches top_p (the first always stays).
    On CPU the nucleus is first looked for among the NUCLEUS_FIRST_TRY likeliest tokens, which
    holds it nearly always: sorting a 49k vocabulary cost 3 ms a token here, more than a
    quarter of a decoding step. (On a GPU the full sort is cheap, and the check would wait on it.)"""
    k = probs.shape[-1] if probs.is_cuda else min(NUCLEUS_FIRST_TRY, probs.shape[-1])
    sorted_p, idx = probs.topk(k, dim=-1)  # descending
    before = sorted_p.cumsum(-1) - sorted_p
    if k < probs.shape[-1] and not bool((before[..., -1] >= top_p).all()):
        return top_p_filter_sorted(probs, top_p)
    return _nucleus(probs, sorted_p, idx, before, top_p)


def top_p_filter_sorted(probs: Tensor, top_p: float) -> Tensor:
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    return _nucleus(probs, sorted_p, idx, sorted_p.cumsum(-1) - sorted_p, top_p)


def _nucleus(probs: Tensor, sorted_p: Tensor, idx: Tensor, before: Tensor, top_p: float) -> Tensor:
    """The kept tokens (mass before them < top_p) of descending sorted_p at vocabulary ids idx,
    scattered back over probs' shape and renormalised."""
    out = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(before >= top_p, 0.0))
    return out / out.sum(-1, keepdim=True)


def draw(dist: Tensor, gen: torch.Generator | None) -> Tensor:
    """[1] index drawn with probability dist[i] / sum(dist) (dist [V], non-negative, some mass):
    inverse CDF over a float64 running sum, one uniform number. torch.multinomial took 1.4 ms a
    token over a 49k vocabulary here; this takes a tenth of that, and never picks a zero."""
    c = dist.double().cumsum(0)
    u = torch.rand(1, generator=gen, dtype=torch.float64, device=dist.device) * c[-1]
    return torch.searchsorted(c, u, right=True).clamp_(max=len(dist) - 1)


def round_generator(seed: int, position: int, stream: str, device="cpu") -> torch.Generator:
    """A generator for one round of one request, derived from (seed, position, stream).

    Deriving it instead of carrying generator state keeps replicas stateless: a drafter or
    verifier that restarts, or a retried call, draws the same numbers, so seeded output is
    reproducible across the distributed deployment too."""
    h = hashlib.blake2b(f"{seed}:{position}:{stream}".encode(), digest_size=8).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))
    return g
