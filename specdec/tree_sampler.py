"""Verification of a token tree: which of a draft tree's paths the verifier keeps, and its next token.

A tree is drafts [n] with parents [n] (-1: a child of the sequence's last token, the root); a
parent comes before its children. Target rows [n + 1]: row 0 is the verifier's p after the root,
row j + 1 its p after draft j (rows of sampled requests are probabilities, greedy ones logits).

Greedy: from the root, follow the child whose token is the verifier's argmax; the first node
without one emits its argmax (a recovered token, or the bonus token at a leaf). So the output is
the verifier's own greedy continuation, whatever the tree.

Sampled (SpecInfer's multi-candidate rejection with one-hot drafts, the candidates being the draft's
likeliest tokens rather than draws from q): at a node, each child x in turn is accepted with
probability r(x) / sum(r), r the verifier's p with the children rejected so far removed; when all
are rejected the token is drawn from r. A child x is then emitted with probability p(x) and any
other token y with (1 - sum of the children's p) p(y) / (1 - sum): exactly p, whatever the draft
proposed. Each request draws from its own generator: one uniform per child tried, one per final draw.
"""
from __future__ import annotations

import torch
from torch import Tensor

from specdec.rejection_sampler import draw_rows


def children_of(parents: list[int]) -> list[list[int]]:
    """By target row (0: the root, j + 1: draft j): the drafts that follow it, in order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, p in enumerate(parents):
        out[p + 1].append(j)
    return out


def greedy_path(drafts: list[int], parents: list[int], argmax: list[int]) -> tuple[list[int], list[int]]:
    """(emitted tokens, accepted drafts by index) given each target row's argmax [n + 1]."""
    children, path, row = children_of(parents), [], 0
    while True:
        nxt = next((c for c in children[row] if drafts[c] == argmax[row]), None)
        if nxt is None:
            return [drafts[c] for c in path] + [argmax[row]], path
        path.append(nxt)
        row = nxt + 1


def residual(r: Tensor, token: int) -> None:
    """A rejected candidate leaves the distribution it was tried against."""
    r[token] = 0.0


def sampled_path(drafts: list[int], parents: list[int], target: Tensor,
                 gen: torch.Generator | None) -> tuple[list[int], list[int]]:
    """(emitted tokens, accepted drafts by index); target [n + 1, V] probabilities."""
    children, path, row = children_of(parents), [], 0
    while True:
        r = target[row].float().clone()  # [V]
        for c in children[row]:
            u = torch.rand(1, generator=gen, dtype=torch.float64, device=r.device)
            if bool(u * r.sum() < r[drafts[c]]):
                path.append(c)
                row = c + 1
                break
            residual(r, drafts[c])
        else:
            w = torch.rand(1, generator=gen, dtype=torch.float64, device=r.device)
            last = int(draw_rows(r.unsqueeze(0), w, target, [row])[0])
            return [drafts[c] for c in path] + [last], path
