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
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p (the first always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    # elementwise, not `if broken.any()`: a host sync per call would stall a GPU verifier's pass
    return torch.where(torch.isfinite(probs).all(dim=-1, keepdim=True), probs, 1.0 / probs.shape[-1])


def round_generator(seed: int, position: int, stream: str, device="cpu") -> torch.Generator:
    """A generator for one round of one request, derived from (seed, position, stream).

    Deriving it instead of carrying generator state keeps replicas stateless: a drafter or
    verifier that restarts, or a retried call, draws the same numbers, so seeded output is
    reproducible across the distributed deployment too."""
    h = hashlib.blake2b(f"{seed}:{position}:{stream}".encode(), digest_size=8).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))
    return g
