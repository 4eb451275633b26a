"""The batch-invariant pass: a ragged batch's real tokens as one [N, dim] matrix, compiled.

Reduced precision is lossless for speculation only if a token's hidden states do not depend on
how many tokens share its pass (a verify pass of K + 1 against K + 1 one-token passes). Every op
here works row by row: matmuls whose rows are computed independently (models.quant), norms and
rotary per row, and attention one token at a time over exactly the keys it sees (`attend_tokens`).
Padding never enters, so neither do masks.

`torch.compile` runs the pass as one graph: a 1-token pass is ~6,500 small ops eagerly, and their
dispatch cost about as much as the weights' reads. The token count N is left symbolic and
unbacked, so one graph serves every N (1 included: a graph specialised to N = 1 fused its
reductions differently and broke invariance), and the attention op stays opaque to the compiler,
so context lengths never reach a guard. On a CPU the code that calls the graph's kernels is
C++ too (inductor's cpp_wrapper), and once compiled it is called past dynamo's guards
(models.compiled). Compiled code is cached under $SPECDEC_HOME/inductor.
"""
from __future__ import annotations

import torch
from torch import Tensor

from specdec.models.compiled import CompiledMethod, tensor_key
from specdec.models.layers import attention


_LIB = torch.library.Library("specdec", "DEF")  # noqa: the op lives as long as the process
_LIB.define("attend_tokens(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor meta, "
            "int window, float scale, float softcap) -> Tensor")


def path_rows(meta: list[list[int]], i: int) -> tuple[int, list[int]]:
    """(first position, rows): where token i's ancestors' keys lie, by position from the first;
    every position before it is its own row (see TokenKV)."""
    rows, a, first = [], i, meta[i][1]
    while a >= 0:
        rows.append(meta[a][2])
        first, a = meta[a][1], meta[a][3]
    return first, rows[::-1]


def attend_tokens(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: Tensor,
                  window: int, scale: float, softcap: float) -> Tensor:
    """Write each token's k/v [N, Hkv, hd] at its (slot, row) (meta [N, 4]: slot, position, row,
    parent), then attend each query q [N, H, hd] over its own keys up to its position (the last
    `window` of them when window > 0), alone: the same call a 1-token pass of that sequence makes
    (softcap 0: none)."""
    k_cache[meta[:, 0], :, meta[:, 2]] = k
    v_cache[meta[:, 0], :, meta[:, 2]] = v
    heads, hd = q.shape[1:]
    out = torch.empty_like(q)
    rows = meta.tolist()
    tree = any(r != p for _, p, r, _ in rows)  # else every position is its own row: slices, no walks
    for i, (s, p, _, _) in enumerate(rows):
        lo = max(0, p + 1 - window) if window > 0 else 0
        idx = slice(lo, p + 1)
        if tree:
            first, path = path_rows(rows, i)
            idx = torch.tensor([j if j < first else path[j - first] for j in range(lo, p + 1)], device=q.device)
        y = attention(q[i].view(1, heads, 1, hd), k_cache[s : s + 1, :, idx], v_cache[s : s + 1, :, idx],
                      None, scale, softcap or None)
        out[i] = y.view(heads, hd)
    return out


# registered straight with the dispatcher (not torch.library.custom_op, whose autograd and
# functionalisation wrappers cost ~100 us a call here: 3 ms of a 1-token pass's 30 calls)
_LIB.impl("attend_tokens", attend_tokens, "CPU")


@torch.library.register_fake("specdec::attend_tokens")
def _(q, k, v, k_cache, v_cache, meta, window, scale, softcap):
    return torch.empty_like(q)


class TokenKV:
    """One layer's slot cache in a token pass, where the pass's tokens go in it, and the attention
    op: specdec's kernel (models.kernels) on CPU in bfloat16, else `attend_tokens` above.

    meta [N, 4] per token: (slot, position, row, parent). A token's K/V go to its row, which is its
    position except in a draft tree (siblings share a position: the tree's nodes take the rows
    after the sequence's, in order). parent: the pass's token one position before on its path
    (-1: every earlier position is its own row). Attention reads keys by position, so a tree node
    computes what the same tokens compute as a plain sequence."""

    def __init__(self, k_cache: Tensor, v_cache: Tensor, meta: Tensor, op):
        self.k_cache, self.v_cache, self.meta, self.op = k_cache, v_cache, meta, op

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int, scale: float, softcap: float) -> Tensor:
        """q [N, H, hd], k/v [N, Hkv, hd]; softcap 0: none."""
        return self.op(q, k, v, self.k_cache, self.v_cache, self.meta, window, scale, softcap)


def attention_op(device: torch.device, dtype: torch.dtype):
    from specdec.models import kernels

    if device.type == "cpu" and dtype == torch.bfloat16 and kernels.load():
        return torch.ops.specdec_attention.attend_tokens
    return torch.ops.specdec.attend_tokens


class TokenPass:
    """`model.token_forward` run eagerly or compiled; call with tokens [N], meta [N, 4] (slot,
    position, row, parent: see TokenKV), rope {kind: (cos, sin) [N, hd]} and the caches."""

    def __init__(self, model: torch.nn.Module, compiled: bool):
        self.compiled = compiled
        w = model.embed.weight
        self.attention = attention_op(w.device, w.dtype)
        if compiled:
            # the code depends on the model (its feature layers) and the caches' shapes, not on the
            # token count (see the module's docstring)
            self._fn = CompiledMethod(
                model.token_forward,
                key=lambda tokens, meta, rope, caches: (model.feature_layers, len(caches),
                                                        tensor_key(caches[0][0]), tensor_key(caches[-1][1])),
                unbacked=lambda tokens, meta, rope, caches: (tokens, meta, *(x for cs in rope.values() for x in cs)))
        else:
            self._fn = model.token_forward

    def __call__(self, tokens: Tensor, meta: Tensor, rope: dict[str, tuple[Tensor, Tensor]],
                 caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        return self._fn(tokens, meta, rope, caches)
