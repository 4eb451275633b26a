"""The rejection sampler: turns draft proposals and verifier probabilities into output tokens.

Vocabulary (as in vLLM):
- `num_speculative_tokens` (K): drafts proposed for a request this round; may differ per request.
- accepted token: a draft token x_i kept with probability min(1, p_i(x_i) / q_i(x_i)).
- recovered token: at the first rejection, a token drawn from norm(max(0, p_i - q_i)) instead.
- bonus token: when all K drafts are accepted, one more token drawn from p_{K+1}.

So every request emits between 1 and K+1 tokens per verifier pass, and the emitted tokens are
distributed exactly as if sampled from p one at a time (Leviathan et al. 2023, Chen et al. 2023).
Greedy requests accept the longest prefix equal to the verifier's argmax, then emit its argmax.

The batch is ragged: draft ids are flat [sum K_i] with per-request counts; target rows are flat
[sum (K_i + 1)]; the output is padded [B, max K_i + 1] with PLACEHOLDER_TOKEN_ID.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from specdec.models import kernels
from specdec.sampling import argmax_rows, inverse_cdf


PLACEHOLDER_TOKEN_ID = -1


def rejection_sample(
    draft_token_ids: Tensor,  # [N] flat, N = sum(num_draft_tokens)
    num_draft_tokens: list[int],  # [B]
    draft_probs: list[Tensor | None],  # per request [K_i, V]; None = one-hot q (greedy draft, n-gram)
    target: Tensor,  # [N + B, V]: probabilities, or for greedy requests anything whose argmax is p's
    greedy: list[bool],  # [B]
    generators: list[torch.Generator | None],  # [B], used by sampled requests only
) -> Tensor:
    B = len(num_draft_tokens)
    starts = list(accumulate((k + 1 for k in num_draft_tokens), initial=0))  # [B + 1]: first target row per request
    # greedy requests need only the argmax of their rows: one batched argmax and one copy to the
    # host for all of them (per-request ops would each wait on the device)
    g_rows = [starts[b] + j for b in range(B) if greedy[b] for j in range(num_draft_tokens[b] + 1)]
    best = {}  # target row -> its argmax
    if g_rows:
        g_target = target if len(g_rows) == target.shape[0] else target[g_rows]
        best = dict(zip(g_rows, argmax_rows(g_target)))
    drafts_all = draft_token_ids.tolist()
    out: list[list[int]] = [[] for _ in range(B)]
    d0 = list(accumulate(num_draft_tokens, initial=0))  # each request's first draft
    for b, k in enumerate(num_draft_tokens):
        if greedy[b]:
            drafts, t0 = drafts_all[d0[b] : d0[b] + k], starts[b]
            argmax = [best[t0 + j] for j in range(k + 1)]  # [K+1]
            n = next((j for j in range(k) if drafts[j] != argmax[j]), k)  # accepted drafts
            out[b] = argmax[: n + 1]  # accepted tokens equal the argmax, then the recovered or bonus argmax
    sampled = [b for b in range(B) if not greedy[b]]
    if sampled:
        reqs = [Sampled(drafts_all[d0[b] : d0[b] + num_draft_tokens[b]], draft_probs[b], starts[b], generators[b])
                for b in sampled]
        for b, toks in zip(sampled, _sampled(reqs, target)):
            out[b] = toks
    width = max(num_draft_tokens, default=0) + 1
    padded = [row + [PLACEHOLDER_TOKEN_ID] * (width - len(row)) for row in out]
    return torch.tensor(padded, dtype=torch.long).view(B, width)


@dataclass
class Sampled:
    """A sampled request's part of the batch: its drafts, their q rows [K, V] (None: one-hot),
    its first target row and its generator."""

    drafts: list[int]
    q: Tensor | None
    row: int
    gen: torch.Generator | None


def _sampled(reqs: list[Sampled], target: Tensor) -> list[list[int]]:
    """Every sampled request's accepted drafts and its recovered or bonus token: the acceptance
    tests, the residuals and the final draws each as one batched op. Each request draws its
    uniform numbers from its own generator, in the order a request alone would: K for its tests,
    then one for its final token."""
    u = [torch.rand(len(r.drafts), generator=r.gen, device=target.device) for r in reqs]
    w = torch.cat([torch.rand(1, generator=r.gen, dtype=torch.float64, device=target.device) for r in reqs])
    n = accepted_lengths(reqs, target, u)
    if all(r.q is None for r in reqs) and kernels.sampling_fused(target):
        last = draw_skipping(target, [r.row + k for r, k in zip(reqs, n)], residual_skips(reqs, n), w)
    else:
        dist, rows = final_rows(reqs, target, n)
        last = draw_rows(dist, w, target, rows).tolist()
    return [r.drafts[:k] + [t] for r, k, t in zip(reqs, n, last)]


def accepted_lengths(reqs: list[Sampled], target: Tensor, u: list[Tensor]) -> list[int]:
    """Drafts each request keeps: x_i is accepted while u_i q_i(x_i) < p_i(x_i) (u_i < p/q, without
    dividing by a zero q), up to the first rejection."""
    rows = torch.tensor([r.row + j for r in reqs for j in range(len(r.drafts))], dtype=torch.long)
    ids = torch.tensor([t for r in reqs for t in r.drafts], dtype=torch.long)
    if not len(ids):
        return [0] * len(reqs)
    p_d = target[rows.to(target.device), ids.to(target.device)]  # [sum K] p_i(x_i)
    q_d = torch.cat([r.q.to(target.device)[torch.arange(len(r.drafts)), torch.tensor(r.drafts)] if r.q is not None
                     else torch.ones(len(r.drafts), device=target.device) for r in reqs])  # [sum K] q_i(x_i)
    keep = (torch.cat(u) * q_d < p_d).tolist()
    out, i = [], 0
    for r in reqs:
        k = len(r.drafts)
        out.append(next((j for j in range(k) if not keep[i + j]), k))
        i += k
    return out


def final_rows(reqs: list[Sampled], target: Tensor, n: list[int]) -> tuple[Tensor, list[int]]:
    """[S, V] what each request's last token is drawn from, unnormalised: at a rejection the
    residual max(0, p - q) (for a one-hot q, p without the draft), after all K the bonus row p;
    and each one's p row in target (its fallback where the residual holds no mass)."""
    rows = [r.row + k for r, k in zip(reqs, n)]
    dist = target[rows].float()  # [S, V], a copy
    with_q = [i for i, (r, k) in enumerate(zip(reqs, n)) if k < len(r.drafts) and r.q is not None]
    if with_q:
        q = torch.stack([reqs[i].q[n[i]] for i in with_q]).to(dist.device)
        dist[with_q] = (dist[with_q] - q).clamp_min_(0.0)
    skips = residual_skips(reqs, n)
    one_hot = [i for i, t in enumerate(skips) if t >= 0]
    if one_hot:
        dist[one_hot, [skips[i] for i in one_hot]] = 0.0
    return dist, rows


def residual_skips(reqs: list[Sampled], n: list[int]) -> list[int]:
    """The token each one-hot request's last draw leaves out of p: its rejected draft (p without it
    is the residual max(0, p - q) for a one-hot q); -1 after all its drafts, or for a q row."""
    return [r.drafts[k] if k < len(r.drafts) and r.q is None else -1 for r, k in zip(reqs, n)]


def draw_skipping(target: Tensor, rows: list[int], skips: list[int], w: Tensor) -> list[int]:
    """final_rows + draw_rows for one-hot q's in sampling.cpp, reading each row in place: a token
    from target[rows[i]] without skips[i] at uniform w[i]; where that leaves no mass, from the row
    itself, and where that has none either, its argmax (as draw_rows falls back)."""
    draw = torch.ops.specdec_sampling.draw
    rows_t, skip_t = torch.tensor(rows), torch.tensor(skips)
    out = draw(target, rows_t, skip_t, w)
    bad = out < 0
    if bool(bad.any()):
        out[bad] = draw(target, rows_t[bad], torch.full_like(skip_t[bad], -1), w[bad])
        still = out < 0
        if bool(still.any()):
            out[still] = target[rows_t[still]].nan_to_num(nan=-1.0).argmax(-1)
    return out.tolist()


def draw_rows(dist: Tensor, w: Tensor, target: Tensor, rows: list[int]) -> Tensor:
    """[S] one token per row of dist [S, V] (modified in place) by inverse CDF at the row's uniform
    w [S], as sampling.draw does for one row. A row with no finite positive mass draws from its
    fallback, target[rows[i]] (no mass left happens only where p == q, where rejection has
    probability 0), and where that has none either takes its argmax: drawing from it would be
    meaningless, and a raise fails the pass of every sequence in the batch."""
    def broken(x: Tensor) -> Tensor:
        mass = x.sum(-1)
        return ~((mass > 0) & (mass < float("inf")))

    bad = broken(dist)
    still = bad
    if bool(bad.any()):
        dist[bad] = target[torch.tensor(rows, device=target.device)[bad]].float()
        still = broken(dist)
    tokens = inverse_cdf(dist, w)
    if bool(still.any()):
        tokens[still] = dist[still].nan_to_num(nan=-1.0).argmax(-1)
    return tokens
