"""The pieces every model family's forward is built from: matmuls with per-row-count kernels, RMSNorm,
rotary embedding, attention over the slot cache of a ragged batch, and the decoder block's shared
attention and gated-MLP halves. Family modules (llama.py, qwen3.py, gemma.py, ...) only arrange them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.models import kernels, quant
from specdec.models.args import ModelArgs

DNN_ROWS_HINT = 8  # the row count oneDNN lays a packed weight out for (it serves every count)


def dnn_pack(weight: Tensor) -> Tensor:
    """weight [out, in] re-laid-out by oneDNN for few-row matmuls (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), DNN_ROWS_HINT)


class Linear(nn.Module):
    """y = x W^T + b with W stored transposed, [in, out] contiguous, plus (after `set_kernels`)
    an [out, in] copy and MKL-packed copies for the row counts where those kernels are faster.

    Why: the matmuls are nearly all of what a (K+1)-token verify pass costs over a 1-token one,
    and which few-row CPU kernel streams the weights fastest depends on the machine's BLAS.
    Measured here (49152-wide LM head, cold cache): x @ W_t 3.7 ms at 1 row but 14 ms at 2-5
    rows; nn.Linear's layout 6.4 ms at 2 rows, 11.6 ms at 5; MKL's packed GEMM, whose weight
    is re-laid-out once for one exact row count, 6.9 ms at 5 rows and 7.9 ms at 9. On an AMD EPYC
    (AVX2, no AVX-512) MKL is the slow one: 52-60 ms at 4 rows and 65-110 at 16 by
    every MKL kernel, where oneDNN's packed weight, one copy serving any row count, takes 11 and
    29 ms. `models.layouts` times them all."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(d_in, d_out))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        self._w: Tensor | None = None  # [out, in] copy, or None when x @ W_t always wins
        # by input rows: "t" x @ W_t, "w" F.linear, "p" MKL-packed, "d" oneDNN-packed (last: more rows)
        self._kernels = ""
        self._packed: dict[int, Tensor] = {}  # rows -> MKL-packed weight for exactly that many
        self._dnn: Tensor | None = None  # oneDNN-packed weight: one copy for every row count
        self._int4: tuple[Tensor, Tensor] | None = None  # (packed weight, scales and zeros): see models.quant
        self._wq: tuple | None = None  # (packed, scales, mins, bits, out): models.kernels' weight-only kernel

    @property
    def weight(self) -> Tensor:
        """[out, in] view, as nn.Linear names it."""
        return self.weight_t.t()

    def set_kernels(self, kernels: str) -> None:
        """kernels[rows] for rows = 0 .. n; the last entry, never "p", serves more rows."""
        assert not kernels or kernels[-1] != "p", "packed weights serve one exact row count"
        self._kernels = kernels if kernels.strip("t") else ""
        self._w = self.weight_t.detach().t().contiguous() if self._kernels.strip("td") else None
        self._packed = {m: torch.ops.mkl._mkl_reorder_linear_weight(self._w, m)
                        for m, k in enumerate(self._kernels) if k == "p"}
        self._dnn = dnn_pack(self.weight_t.detach().t()) if "d" in self._kernels else None

    def quantize_int4(self) -> None:
        """From now on multiply by the weight quantised to 4 bits (one kernel for every row count):
        specdec's kernel where it builds, else torch's."""
        w = self.weight_t.detach().t()
        if kernels.load() and kernels.fits(w):
            self._wq = (*kernels.quantize_q4(w), 4, w.shape[0])
        else:
            self._int4 = quant.quantize(w)
        self._kernels = ""

    def quantize_int8(self) -> None:
        """From now on multiply by the weight quantised to 8 bits per group of 32 (models.kernels)."""
        w = self.weight_t.detach().t()
        self._wq = (*kernels.quantize_q8(w), 8, w.shape[0])
        self._kernels = ""

    @property
    def quantized(self) -> bool:
        return self._int4 is not None or self._wq is not None

    def forward(self, x: Tensor) -> Tensor:
        if self._wq is not None or self._int4 is not None:
            y = quant.matmul(x, *self._int4) if self._wq is None else kernels.matmul(x, *self._wq)
            return y + self.bias if self.bias is not None else y
        if self._kernels:
            rows = x.numel() // x.shape[-1]
            kind = self._kernels[min(rows, len(self._kernels) - 1)]
            if kind == "p":
                return torch.ops.mkl._mkl_linear(x.contiguous(), self._packed[rows], self._w, self.bias, rows)
            if kind == "d":
                return torch.ops.mkldnn._linear_pointwise(x, self._dnn, self.bias, "none", [], "")
            if kind == "w":
                return F.linear(x, self._w, self.bias)
        y = x @ self.weight_t
        return y + self.bias if self.bias is not None else y


class RMSNorm(nn.Module):
    """x / rms(x) * w. Gemma's (1 + w) norms load as w' = 1 + w, so one module serves every family
    (and the draft head, which reads the final norm's weight, sees the effective scale)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's non-interleaved rotary embedding. x: [B, T, H, hd]; cos/sin: [B, T, 1, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float | None,
              softcap: float | None) -> Tensor:
    """q [B, H, T, hd], keys/values [B, Hkv, ctx, hd] (GQA), mask [B, 1, T, ctx] bool -> [B, H, T, hd].
    Logit soft-capping (Gemma 2) needs the scores themselves, which SDPA never shows: then the
    scores are computed here, as HF's eager attention does."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    rep = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    scores = (q @ keys.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values


class LayerKV:
    """One layer's view of the slot cache for the current forward pass."""

    def __init__(self, k_cache: Tensor, v_cache: Tensor, batch: "BatchIndex"):
        self.k_cache, self.v_cache, self.batch = k_cache, v_cache, batch

    def write_and_read(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        b = self.batch
        # k, v: [B, T, Hkv, hd] written at (slot, position); padded rows go to the trash position
        self.k_cache[b.slot_index, :, b.write_pos] = k
        self.v_cache[b.slot_index, :, b.write_pos] = v
        if b.slot_range is not None:  # contiguous slots: a view, no copy
            s0, s1 = b.slot_range
            return self.k_cache[s0:s1, :, : b.ctx], self.v_cache[s0:s1, :, : b.ctx]
        return self.k_cache[b.slots, :, : b.ctx], self.v_cache[b.slots, :, : b.ctx]


class BatchIndex:
    """Where each row of a ragged batch lives in the slot cache.

    trees[b] (None: a chain, each input following the one before) gives a draft tree's inputs'
    parents among that sequence's inputs (-1: the first input, which follows the slot's tokens).
    A tree's inputs take the rows after the sequence's tokens, in order, each at the position of
    its depth, and each sees the sequence's tokens and its own ancestors."""

    def __init__(self, slots: list[int], start_pos: list[int], lengths: list[int], trash_pos: int, device,
                 trees: list[list[int] | None] | None = None):
        B, T = len(slots), max(lengths)
        self.start_pos, self.lengths = list(start_pos), list(lengths)
        trees = trees if trees is not None and any(t is not None for t in trees) else None
        # the index arithmetic in Python, one tensor at the end: as a dozen small tensor ops it took
        # ~0.3 ms of every pass on a 2-core CPU, for a few dozen numbers
        rope, write, meta, par, depth = [], [], [], [], []
        for b, (slot, s0, n) in enumerate(zip(slots, start_pos, lengths)):
            tree = trees[b] if trees is not None else None
            d = node_depths(tree) + list(range(len(tree), T)) if tree is not None else list(range(T))
            p = list(tree) + [t - 1 if t < n else -1 for t in range(len(tree), T)] if tree is not None \
                else [t - 1 if t < n else -1 for t in range(T)]
            rope.append([s0 + d[t] if t < n else 0 for t in range(T)])
            write.append([s0 + t if t < n else trash_pos for t in range(T)])
            first = len(meta)  # the sequence's first row among the batch's real inputs
            meta += [[slot, rope[b][t], write[b][t], p[t] + first if p[t] >= 0 else -1] for t in range(n)]
            par.append(p)
            depth.append(d)
        self.rope_pos, self.write_pos = torch.tensor([rope, write]).to(device).unbind(0)
        # [N, 4] each real input's (slot, position, row, parent among the real inputs; -1: none),
        # what a token pass reads (token_pass.TokenKV)
        self.meta = torch.tensor(meta).to(device)
        valid = torch.tensor([[t < n for t in range(T)] for n in lengths])  # [B, T]
        self.slots = torch.tensor(slots, device=device)
        self.slot_index = self.slots.unsqueeze(1)  # [B, 1], broadcasts against write_pos
        self.ctx = max(s + n for s, n in zip(start_pos, lengths))
        s0 = slots[0]
        self.slot_range = (s0, s0 + B) if slots == list(range(s0, s0 + B)) else None
        self._tree = (torch.tensor(par), torch.tensor(depth), valid) if trees is not None else None
        self._masks: dict[int | None, Tensor | None] = {}  # by window, built on first use (token passes use none)
        self._key_pos: Tensor | None = None  # [B, ctx] each cached row's position (trees only)
        self.valid = valid.to(device)
        # the real tokens' places in the flattened [B * T] batch, when some rows are padding: a
        # round where a few sequences of a big batch verify K drafts and the rest one token would
        # otherwise run every matmul over B * (K + 1) rows (4x the work at 16 sequences and K = 3)
        self.rows = None if min(lengths) == T else valid.flatten().nonzero().squeeze(1).to(device)

    @property
    def mask(self) -> Tensor | None:
        """[B, 1, T, ctx] which cached rows each query sees (None: one query, every row)."""
        if None not in self._masks:
            B, T = self.rope_pos.shape
            dev = self.rope_pos.device
            if B == 1 and T == 1:
                self._masks[None] = None  # one query attends to the whole context: no mask needed
            elif self._tree is None:  # query at position p sees keys 0..p; padded queries see key 0 only (kept finite)
                keys = torch.arange(self.ctx, device=dev)
                self._masks[None] = (keys.view(1, 1, -1) <= self.rope_pos.unsqueeze(-1)).unsqueeze(1)
            else:
                mask, key_pos = _tree_mask(*self._tree, self.start_pos, self.ctx)
                self._masks[None], self._key_pos = mask.to(dev), key_pos.to(dev)
        return self._masks[None]

    def mask_for(self, window: int | None) -> Tensor | None:
        """The mask of a layer that sees only the last `window` positions (HF: key > query - window).
        The cache keeps every position; a sliding layer just masks out the old ones."""
        if window is None or self.ctx <= window:  # every key a query may see is inside its window
            return self.mask
        if window not in self._masks:
            keys = torch.arange(self.ctx, device=self.rope_pos.device).view(1, 1, -1)
            pos = self.rope_pos.unsqueeze(-1)  # [B, T, 1]
            if self._tree is None or self.mask is None:  # a chain, or one query (a tree of its root alone)
                self._masks[window] = ((keys <= pos) & (keys > pos - window)).unsqueeze(1)
            else:  # a tree's rows hold positions of their depth
                self._masks[window] = self.mask & (self._key_pos.unsqueeze(1) > pos - window).unsqueeze(1)
        return self._masks[window]


def node_depths(parents: list[int]) -> list[int]:
    """Each node's depth in a tree given as parents (-1: a child of the root), parents first."""
    d: list[int] = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def draft_depth(token_ids: list[int], parents: list[int] | None) -> int:
    """Positions drafts take: a chain's length, a token tree's depth (parents None: a chain)."""
    return len(token_ids) if parents is None else max(node_depths(parents), default=-1) + 1


def _tree_mask(par: Tensor, depth: Tensor, valid: Tensor, start_pos: list[int], ctx: int) -> tuple[Tensor, Tensor]:
    """([B, 1, T, ctx] which cached rows each input sees, [B, ctx] each row's position): the
    sequence's own tokens and the input's ancestors (itself included); padding sees row 0."""
    B, T = par.shape
    anc = torch.zeros(B, T, T, dtype=torch.bool)
    for t in range(T):  # parents come first, so their rows are complete
        anc[:, t, t] = True
        has = par[:, t] >= 0
        anc[has, t] |= anc[has, par[has, t]]
    keys = torch.arange(ctx).unsqueeze(0)  # [1, ctx]
    start = torch.tensor(start_pos).unsqueeze(1)  # [B, 1]
    rel = keys - start  # [B, ctx] row within the inputs
    inside = (rel >= 0) & (rel < T)
    sees = anc.gather(2, rel.clamp(0, T - 1).unsqueeze(1).expand(B, T, ctx)) & inside.unsqueeze(1)  # [B, T, ctx]
    mask = (rel < 0).unsqueeze(1) | sees
    mask = torch.where(valid.unsqueeze(-1), mask, keys.unsqueeze(1) == 0)
    key_pos = torch.where(inside, start + depth.gather(1, rel.clamp(0, T - 1)), keys)
    return mask.unsqueeze(1), key_pos


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh, "gelu": F.gelu}  # by ModelArgs.act


class DecoderBlock(nn.Module):
    """What every family's block shares: fused q/k/v and gate/up matmuls (half the kernel launches
    of HF's layout), optional per-head q/k norms, attention over the slot cache, the gated MLP.
    Subclasses place the norms and residuals."""

    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.a = a
        hd = a.head_dim
        self.window = a.window(layer)  # None: attends to every position
        self.rope_kind = a.rope_kind(layer)  # which rotary table it reads (Gemma 3's sliding layers: "local")
        self.wqkv = Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * hd, bias=a.attention_bias)
        self.wo = Linear(a.n_heads * hd, a.dim, bias=a.out_bias)
        self.w13 = Linear(a.dim, 2 * a.intermediate_size, bias=a.mlp_bias)
        self.w2 = Linear(a.intermediate_size, a.dim, bias=a.mlp_bias)
        self.q_norm = RMSNorm(hd, a.norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(hd, a.norm_eps) if a.qk_norm else None
        self.act = ACTIVATIONS[a.act]

    def attend(self, h: Tensor, cos: Tensor, sin: Tensor, kv: LayerKV, mask: Tensor | None,
               rows: Tensor | None) -> Tensor:
        """Attention over normed inputs h: [B, T, dim]; or, for a ragged batch, only its real tokens
        [N, dim] with `rows` their places in the flattened [B * T] (see BatchIndex.rows): the
        matmuls then skip the padding and only attention, which is per sequence, sees [B, T]."""
        a = self.a
        if not isinstance(kv, LayerKV):  # a token pass (models.token_pass): h is [N, dim], cos [N, 1, hd]
            return self.attend_tokens(h, cos, sin, kv)
        B, T = cos.shape[:2]
        hd = a.head_dim
        qkv = self.wqkv(h)  # [B, T, (H + 2Hkv) * hd], or [N, ...]
        if rows is not None:  # padded rows get zeros: their keys/values go to the trash position
            qkv = qkv.new_zeros(B * T, qkv.shape[-1]).index_copy_(0, rows, qkv).view(B, T, -1)
        q, k, v = qkv.split([a.n_heads * hd, a.n_kv_heads * hd, a.n_kv_heads * hd], dim=-1)
        q, k = q.view(B, T, a.n_heads, hd), k.view(B, T, a.n_kv_heads, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [B, H, T, hd]
        keys, values = kv.write_and_read(apply_rope(k, cos, sin), v.view(B, T, a.n_kv_heads, hd))
        y = attention(q, keys, values, mask, a.attn_scale, a.attn_softcap)
        y = y.transpose(1, 2).reshape(B, T, a.n_heads * hd)
        if rows is not None:
            y = y.reshape(B * T, -1).index_select(0, rows)  # [N, H * hd]
        return self.wo(y)

    def attend_tokens(self, h: Tensor, cos: Tensor, sin: Tensor, kv) -> Tensor:
        """attend() in a token pass: N real tokens, each attending alone (token_pass.attend_tokens)."""
        a = self.a
        hd = a.head_dim
        q, k, v = self.wqkv(h).split([a.n_heads * hd, a.n_kv_heads * hd, a.n_kv_heads * hd], dim=-1)
        q, k = q.view(-1, a.n_heads, hd), k.view(-1, a.n_kv_heads, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = kv.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(-1, a.n_kv_heads, hd),
                      self.window or 0, a.attn_scale or hd**-0.5, a.attn_softcap or 0.0)
        return self.wo(y.view(-1, a.n_heads * hd))

    def mlp(self, h: Tensor) -> Tensor:
        gate, up = self.w13(h).chunk(2, dim=-1)
        return self.w2(self.act(gate) * up)

    @torch.no_grad()
    def load_hf(self, g, p: str) -> None:
        """Attention and MLP weights from HF names under prefix p; g(name) returns a tensor."""
        a = self.a
        self.wqkv.weight_t.copy_(torch.cat([g(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).t())
        if a.attention_bias:
            self.wqkv.bias.copy_(torch.cat([g(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
        self.wo.weight_t.copy_(g(p + "self_attn.o_proj.weight").t())
        if a.out_bias:
            self.wo.bias.copy_(g(p + "self_attn.o_proj.bias"))
        self.w13.weight_t.copy_(torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")]).t())
        self.w2.weight_t.copy_(g(p + "mlp.down_proj.weight").t())
        if a.mlp_bias:
            self.w13.bias.copy_(torch.cat([g(p + "mlp.gate_proj.bias"), g(p + "mlp.up_proj.bias")]))
            self.w2.bias.copy_(g(p + "mlp.down_proj.bias"))
        if self.q_norm is not None:
            self.q_norm.weight.copy_(a.norm_weight(g(p + "self_attn.q_norm.weight")))
            self.k_norm.weight.copy_(a.norm_weight(g(p + "self_attn.k_norm.weight")))
