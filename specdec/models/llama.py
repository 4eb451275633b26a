"""A Llama-family decoder written for speculative decoding (gpt-fast style).

Why our own module rather than HF's forward: HF runs one sequence at a time with a growing cache,
while verification needs a *ragged* batch (each sequence at its own position, each with its own
number of new tokens) written into a preallocated slot cache, and a cheap way to drop rejected
positions (we just overwrite them next round). Fewer, fused matmuls also cut the per-op overhead
that dominates a 1-token step on a small CPU.

Weights come from an HF `LlamaForCausalLM`-shaped state dict (Llama, SmolLM2, Qwen2-style biases).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass
class ModelArgs:
    vocab_size: int = 49152  # tokens in the embedding / LM head
    dim: int = 576  # hidden size
    n_layers: int = 30  # decoder blocks
    n_heads: int = 9  # query heads
    n_kv_heads: int = 3  # key/value heads (GQA when < n_heads)
    intermediate_size: int = 1536  # MLP width
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    max_position: int = 8192  # longest context the weights were trained for
    attention_bias: bool = False  # Qwen2-style q/k/v biases
    tie_embeddings: bool = True  # LM head shares the embedding matrix

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_hf(cls, cfg) -> "ModelArgs":
        """From a transformers `LlamaConfig`-like object."""
        rope_theta = getattr(cfg, "rope_theta", None)
        if rope_theta is None:  # transformers 5 keeps it under rope_parameters
            rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=cfg.vocab_size,
            dim=cfg.hidden_size,
            n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            intermediate_size=cfg.intermediate_size,
            rope_theta=float(rope_theta),
            norm_eps=cfg.rms_norm_eps,
            max_position=getattr(cfg, "max_position_embeddings", 8192),
            # Qwen2 always has q/k/v biases and says so only through its model type
            attention_bias=bool(getattr(cfg, "attention_bias", False)) or getattr(cfg, "model_type", "") == "qwen2",
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        )


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
    (AVX2, no AVX-512; session 15) MKL is the slow one: 52-60 ms at 4 rows and 65-110 at 16 by
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

    def forward(self, x: Tensor) -> Tensor:
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
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        hd = a.head_dim
        # q, k and v in one matmul, gate and up in another: half the kernel launches of HF's layout
        self.wqkv = Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * hd, bias=a.attention_bias)
        self.wo = Linear(a.n_heads * hd, a.dim, bias=False)
        self.w13 = Linear(a.dim, 2 * a.intermediate_size, bias=False)
        self.w2 = Linear(a.intermediate_size, a.dim, bias=False)
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.mlp_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: "LayerKV", mask: Tensor | None,
                rows: Tensor | None = None) -> Tensor:
        """x: [B, T, dim]; or, for a ragged batch, only its real tokens [N, dim] with `rows` their
        places in the flattened [B * T] (see BatchIndex.rows): the matmuls then skip the padding
        and only attention, which is per sequence, sees the padded [B, T] layout."""
        a = self.a
        B, T = cos.shape[:2]
        hd = a.head_dim
        qkv = self.wqkv(self.attn_norm(x))  # [B, T, (H + 2Hkv) * hd], or [N, ...]
        if rows is not None:  # padded rows get zeros: their keys/values go to the trash position
            qkv = qkv.new_zeros(B * T, qkv.shape[-1]).index_copy_(0, rows, qkv).view(B, T, -1)
        q, k, v = qkv.split([a.n_heads * hd, a.n_kv_heads * hd, a.n_kv_heads * hd], dim=-1)
        q = _rope(q.view(B, T, a.n_heads, hd), cos, sin).transpose(1, 2)  # [B, H, T, hd]
        k = _rope(k.view(B, T, a.n_kv_heads, hd), cos, sin)  # [B, T, Hkv, hd]
        v = v.view(B, T, a.n_kv_heads, hd)
        keys, values = kv.write_and_read(k, v)  # [B, Hkv, ctx, hd] each
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        y = y.transpose(1, 2).reshape(B, T, a.n_heads * hd)
        if rows is not None:
            y = y.reshape(B * T, -1).index_select(0, rows)  # [N, H * hd]
        x = x + self.wo(y)
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's non-interleaved rotary embedding. x: [B, T, H, hd]; cos/sin: [B, T, 1, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


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
    """Where each row of a ragged batch lives in the slot cache."""

    def __init__(self, slots: list[int], start_pos: list[int], lengths: list[int], trash_pos: int, device):
        B, T = len(slots), max(lengths)
        pos = torch.arange(T).unsqueeze(0) + torch.tensor(start_pos).unsqueeze(1)  # [B, T]
        valid = torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # [B, T]
        self.rope_pos = torch.where(valid, pos, 0).to(device)
        self.write_pos = torch.where(valid, pos, trash_pos).to(device)
        self.slots = torch.tensor(slots, device=device)
        self.slot_index = self.slots.unsqueeze(1)  # [B, 1], broadcasts against write_pos
        self.ctx = max(s + n for s, n in zip(start_pos, lengths))
        s0 = slots[0]
        self.slot_range = (s0, s0 + B) if slots == list(range(s0, s0 + B)) else None
        if B == 1 and T == 1:
            self.mask = None  # one query attends to the whole context: no mask needed
        else:  # query at position p sees keys 0..p; padded queries see key 0 only (kept finite)
            keys = torch.arange(self.ctx, device=device)
            self.mask = (keys.view(1, 1, -1) <= self.rope_pos.unsqueeze(-1)).unsqueeze(1)  # [B, 1, T, ctx]
        self.valid = valid.to(device)
        # the real tokens' places in the flattened [B * T] batch, when some rows are padding: a
        # round where a few sequences of a big batch verify K drafts and the rest one token would
        # otherwise run every matmul over B * (K + 1) rows (4x the work at 16 sequences and K = 3)
        self.rows = None if bool(valid.all()) else valid.flatten().nonzero().squeeze(1).to(device)


# On Hopper and newer, torch sends attention with a mask to cuDNN first, which builds a plan for
# every new shape (20-40 ms each on the lent H200); decoding meets a new context length every step
# and a new (batch, tokens) shape with every K, so those plans were most of a round's time there.
_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.lm_head = Linear(a.dim, a.vocab_size, bias=False)
        self._rope_cache: tuple[Tensor, Tensor] | None = None

    def rope_tables(self, device, dtype) -> tuple[Tensor, Tensor]:
        if self._rope_cache is None or self._rope_cache[0].device != torch.device(device):
            a = self.args
            inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float64) / a.head_dim))
            freqs = torch.outer(torch.arange(a.max_position, dtype=torch.float64), inv)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cache = (emb.cos().to(device, dtype), emb.sin().to(device, dtype))
        return self._rope_cache

    def forward(self, tokens: Tensor, batch: BatchIndex, caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """tokens: [B, T] padded; returns the last layer's hidden states [B, T, dim], before the
        final norm (EAGLE-style draft heads read these features). No LM head here: the caller
        picks the rows it needs first, because the LM head is the most expensive matmul."""
        B, T = tokens.shape
        rows = batch.rows
        x = self.embed(tokens if rows is None else tokens.reshape(-1).index_select(0, rows))  # [B, T, dim] or [N, dim]
        cos_t, sin_t = self.rope_tables(x.device, x.dtype)
        cos = cos_t[batch.rope_pos].unsqueeze(2)  # [B, T, 1, hd]
        sin = sin_t[batch.rope_pos].unsqueeze(2)
        with sdpa_kernel(_NOT_CUDNN) if x.is_cuda else contextlib.nullcontext():
            for layer, (kc, vc) in zip(self.layers, caches):
                x = layer(x, cos, sin, LayerKV(kc, vc, batch), batch.mask, rows)
        if rows is not None:  # back to [B, T, dim], padding as zeros
            x = x.new_zeros(B * T, x.shape[-1]).index_copy_(0, rows, x).view(B, T, -1)
        return x

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm and LM head over pre-norm hidden states [..., dim] -> [..., V] fp32."""
        return self.lm_head(self.norm(hidden)).float()

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Copy weights from HF Llama names, fusing q/k/v and gate/up."""
        a = self.args
        g = lambda name: sd[name]  # noqa: E731
        self.embed.weight.copy_(g("model.embed_tokens.weight"))
        self.norm.weight.copy_(g("model.norm.weight"))
        head = sd.get("lm_head.weight")
        self.lm_head.weight_t.copy_((head if head is not None and not a.tie_embeddings
                                     else g("model.embed_tokens.weight")).t())
        for i, blk in enumerate(self.layers):
            p = f"model.layers.{i}."
            blk.wqkv.weight_t.copy_(torch.cat([g(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).t())
            if a.attention_bias:
                blk.wqkv.bias.copy_(torch.cat([g(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            blk.wo.weight_t.copy_(g(p + "self_attn.o_proj.weight").t())
            blk.w13.weight_t.copy_(torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")]).t())
            blk.w2.weight_t.copy_(g(p + "mlp.down_proj.weight").t())
            blk.attn_norm.weight.copy_(g(p + "input_layernorm.weight"))
            blk.mlp_norm.weight.copy_(g(p + "post_attention_layernorm.weight"))
