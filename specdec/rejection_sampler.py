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

from itertools import accumulate

import torch
from torch import Tensor

from specdec.sampling import draw

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
        best = dict(zip(g_rows, g_target.argmax(dim=-1).tolist()))
    drafts_all = draft_token_ids.tolist()
    out = []
    d0 = 0
    for b, k in enumerate(num_draft_tokens):
        t0 = starts[b]
        drafts = drafts_all[d0 : d0 + k]  # [K]
        if greedy[b]:
            argmax = [best[t0 + j] for j in range(k + 1)]  # [K+1]
            n = next((j for j in range(k) if drafts[j] != argmax[j]), k)  # accepted drafts
            out.append(argmax[: n + 1])  # accepted tokens equal the argmax, then the recovered or bonus argmax
        else:
            rows = target[t0 : t0 + k + 1]  # [K+1, V]
            out.append(_sampled(draft_token_ids[d0 : d0 + k], draft_probs[b], rows, generators[b]).tolist())
        d0 += k
    width = max(num_draft_tokens, default=0) + 1
    padded = [row + [PLACEHOLDER_TOKEN_ID] * (width - len(row)) for row in out]
    return torch.tensor(padded, dtype=torch.long).view(B, width)


def _sampled(drafts: Tensor, q: Tensor | None, p: Tensor, gen: torch.Generator | None) -> Tensor:
    k = len(drafts)
    idx = torch.arange(k, device=p.device)
    drafts = drafts.to(p.device)
    q = q.to(p.device) if q is not None else None  # the drafter may live on another device
    p_d = p[idx, drafts]  # [K] p_i(x_i)
    q_d = q[idx, drafts] if q is not None else torch.ones(k, device=p.device)  # [K] q_i(x_i)
    u = torch.rand(k, generator=gen, device=p.device)
    # u * q < p  <=>  u < p / q, without dividing by a zero q
    rejected = (u * q_d >= p_d).nonzero()
    n = int(rejected[0]) if len(rejected) else k
    if n < k:
        residual = p[n].clone()
        if q is not None:
            residual = (residual - q[n]).clamp_min_(0.0)
        else:
            residual[drafts[n]] = 0.0
        last = _draw(residual, gen, p[n])  # no mass left only when p == q, where rejection has probability 0
    else:
        last = _draw(p[k], gen)  # bonus
    return torch.cat([drafts[:n], last])


def _draw(dist: Tensor, gen: torch.Generator | None, fallback: Tensor | None = None) -> Tensor:
    """[1] token from an unnormalized distribution; where it holds no finite positive mass, from
    `fallback`, else its argmax: drawing from it would be meaningless, and a raise fails the pass of every
    sequence in the batch."""
    if not 0.0 < float(dist.sum()) < float("inf"):
        return _draw(fallback, gen) if fallback is not None else dist.nan_to_num(nan=-1.0).argmax().view(1)
    return draw(dist, gen)
