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

from specdec.models import kernels


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


def argmax_rows(x: Tensor) -> list[int]:
    """Each row's argmax of x [N, V], as torch.argmax gives it (the first of equal maxima; a NaN
    counts as the largest), on the host. On a CPU with AVX2 or AVX-512 a kernel takes a row alone:
    torch's op spreads it over the thread team, whose wake-up a greedy pass paid every time."""
    if x.dtype == torch.float32 and kernels.sampling_fused(x):
        return torch.ops.specdec_sampling.argmax(x)
    return x.argmax(dim=-1).tolist()


def logits_to_probs(logits: Tensor, p: SamplingParams | list[SamplingParams]) -> Tensor:
    """[N, V] logits -> [N, V] probabilities under temperature, top-k and top-p (fp32), with one
    SamplingParams for all rows or one per row: a batch's rows are transformed together, each by
    its own request's parameters, in a handful of ops whatever the batch (on a CPU with AVX2 or
    AVX-512, in one kernel call: specdec/models/kernels/sampling.cpp, the same transform).

    Scaled in log space from each row's maximum: (logit - max) / T is 0 for the likeliest token
    and finite or -inf for the rest at any temperature, so no row ever holds inf - inf. A row
    with no finite logit (a broken model output) samples uniformly rather than failing the batch."""
    shape = logits.shape
    logits = logits.reshape(-1, shape[-1])
    rows = p if isinstance(p, list) else [p] * logits.shape[0]
    inv_t = torch.tensor([1.0 / max(r.temperature, SAMPLING_EPS) for r in rows], device=logits.device)
    ks = [r.top_k if 0 < r.top_k < logits.shape[-1] else 0 for r in rows]
    if kernels.sampling_fused(logits):
        top_p = torch.tensor([r.top_p for r in rows])
        return torch.ops.specdec_sampling.probs(logits.float(), inv_t, torch.tensor(ks), top_p).view(shape)
    return _probs(logits, inv_t[:, None], ks, [r.top_p for r in rows]).view(shape)


def _probs(logits: Tensor, inv_t: Tensor, ks: list[int], top_ps: list[float]) -> Tensor:
    """logits_to_probs in torch's ops: inv_t [N, 1], each row's top-k (0: none) and top-p."""
    dev = logits.device
    x = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    top = x.amax(dim=-1, keepdim=True)
    finite = torch.isfinite(top)  # [N, 1]: the row has a finite logit (else it is all -inf)
    x = (x - torch.where(finite, top, 0.0)) * inv_t
    if any(ks):  # the kth value of each row that has a k: x's top max(k), read at k - 1
        kth = torch.topk(x, max(ks), dim=-1).values.gather(-1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])
        x = x.masked_fill((x < kth) & torch.tensor([k > 0 for k in ks], device=dev)[:, None], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    nucleus = [i for i, t in enumerate(top_ps) if t < 1.0]
    if nucleus:
        top_p = torch.tensor([top_ps[i] for i in nucleus], device=dev)[:, None]
        if len(nucleus) == len(top_ps):
            probs = top_p_filter(probs, top_p)
        else:
            probs[nucleus] = top_p_filter(probs[nucleus], top_p)
    # a row is finite wherever its maximum is: its max scales to 0, so its softmax sums to >= 1.
    # Elementwise, not `if broken.any()`: a host sync per call would stall a GPU verifier's pass
    return torch.where(finite, probs, 1.0 / probs.shape[-1])


NUCLEUS_FIRST_TRY = 256  # top-p looks for the nucleus among this many likeliest tokens first


def top_p_filter(probs: Tensor, top_p: float | Tensor) -> Tensor:
    """Keep the smallest set of likeliest tokens whose mass reaches top_p (a number, or [N, 1] one
    per row), renormalised: a token is dropped when the mass strictly before it already reaches
    top_p (the first always stays).
    On CPU the nucleus is first looked for among the NUCLEUS_FIRST_TRY likeliest tokens, which
    holds it nearly always: sorting a 49k vocabulary cost 3 ms a token here, more than a
    quarter of a decoding step. (On a GPU the full sort is cheap, and the check would wait on it.)"""
    k = probs.shape[-1] if probs.is_cuda else min(NUCLEUS_FIRST_TRY, probs.shape[-1])
    sorted_p, idx = probs.topk(k, dim=-1)  # descending
    before = sorted_p.cumsum(-1) - sorted_p
    if k < probs.shape[-1] and not bool((before[..., -1:] >= top_p).all()):
        return top_p_filter_sorted(probs, top_p)
    return _nucleus(probs, sorted_p, idx, before, top_p)


def top_p_filter_sorted(probs: Tensor, top_p: float | Tensor) -> Tensor:
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    return _nucleus(probs, sorted_p, idx, sorted_p.cumsum(-1) - sorted_p, top_p)


def _nucleus(probs: Tensor, sorted_p: Tensor, idx: Tensor, before: Tensor, top_p: float | Tensor) -> Tensor:
    """The kept tokens (mass before them < top_p) of descending sorted_p at vocabulary ids idx,
    scattered back over probs' shape and renormalised."""
    kept = sorted_p.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, kept * (1.0 / kept.sum(-1, keepdim=True)))


def draw(dist: Tensor, gen: torch.Generator | None) -> Tensor:
    """[1] index drawn with probability dist[i] / sum(dist) (dist [V], non-negative, some mass),
    at one uniform number from gen. torch.multinomial took 1.4 ms a token over a 49k vocabulary
    here; the inverse CDF takes a tenth of that, and never picks a zero."""
    return inverse_cdf(dist[None], torch.rand(1, generator=gen, dtype=torch.float64, device=dist.device))


def inverse_cdf(dist: Tensor, w: Tensor) -> Tensor:
    """[S] one index per row of dist [S, V] (non-negative, some mass) at the row's uniform w [S]
    (float64, in [0, 1)): where w times the row's mass falls in its float64 running sum."""
    c = dist.double().cumsum(-1)
    return torch.searchsorted(c, (w * c[:, -1])[:, None], right=True)[:, 0].clamp_(max=dist.shape[-1] - 1)


def round_generator(seed: int, position: int, stream: str, device="cpu") -> torch.Generator:
    """A generator for one round of one request, derived from (seed, position, stream).

    Deriving it instead of carrying generator state keeps replicas stateless: a drafter or
    verifier that restarts, or a retried call, draws the same numbers, so seeded output is
    reproducible across the distributed deployment too."""
    h = hashlib.blake2b(f"{seed}:{position}:{stream}".encode(), digest_size=8).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))
    return g
