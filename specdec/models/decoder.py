"""Decoder: the model interface the runner, the verifier and the draft head use, shared by every family.

Why our own forward rather than HF's: HF runs one sequence at a time with a growing cache, while
verification needs a *ragged* batch (each sequence at its own position, each with its own number of
new tokens) written into a preallocated slot cache, and a cheap way to drop rejected positions (we
just overwrite them next round). Fewer, fused matmuls also cut the per-op overhead that dominates a
1-token step on a small CPU.

The interface: `forward(tokens, batch, caches)` -> pre-norm hidden states; `logits(hidden)`; `args`
(a ModelArgs); `embed`, `norm` and `lm_head` (the draft head reads them); `load_hf_state_dict`. A
family subclasses it with its block class (`block_cls`) and its config reading (`hf_args`).
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdec.models.args import ModelArgs
from specdec.models.layers import BatchIndex, DecoderBlock, LayerKV, Linear, RMSNorm
from specdec.models.rope import rope_table

# On Hopper and newer, torch sends attention with a mask to cuDNN first, which builds a plan for
# every new shape (20-40 ms each on the lent H200); decoding meets a new context length every step
# and a new (batch, tokens) shape with every K, so those plans were most of a round's time there.
_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
ROPE_ROWS = 8192  # positions a rotary table first holds; it doubles when a sequence goes further


class Decoder(nn.Module):
    block_cls: type[DecoderBlock]  # each family sets its own

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(self.block_cls(a, i) for i in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.lm_head = Linear(a.dim, a.vocab_size, bias=False)
        self._rope_cache: dict[str, tuple[Tensor, Tensor]] = {}
        self._rope_kinds = sorted({a.rope_kind(i) for i in range(a.n_layers)})
        self.logits_size = a.vocab_size  # see pad_vocab
        self.token_pass = None  # set by use_token_pass: batch-invariant passes (reduced precision)
        self.feature_layers: tuple[int, ...] = ()  # layers whose outputs lead each hidden row (see forward)

    @classmethod
    def hf_args(cls, cfg) -> ModelArgs:
        """ModelArgs from a transformers config of this family."""
        return ModelArgs.from_hf(cfg)

    def rope_tables(self, kind: str, n: int, device, dtype) -> tuple[Tensor, Tensor]:
        """cos/sin [>= n, head_dim] for the "global" or "local" layers, built on first need."""
        cached = self._rope_cache.get(kind)
        if cached is None or len(cached[0]) < n or cached[0].device != torch.device(device) or cached[0].dtype != dtype:
            have = len(cached[0]) if cached is not None else 0
            rows = max(n, min(self.args.max_position, max(ROPE_ROWS, 2 * have)))
            cos, sin = rope_table(self.args.rope_params(kind), self.args.head_dim, rows)
            self._rope_cache[kind] = (cos.to(device, dtype), sin.to(device, dtype))
        return self._rope_cache[kind]

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        if self.logits_size > self.args.vocab_size:  # a padded draft reads ids of its verifier's padding rows too
            tokens = tokens.clamp(max=self.args.vocab_size - 1)
        x = self.embed(tokens)
        if self.args.embed_scale != 1.0:  # Gemma: the scale rounded to the weights' dtype, as HF does
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        return x

    def forward(self, tokens: Tensor, batch: BatchIndex, caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """tokens: [B, T] padded; returns the last layer's hidden states [B, T, dim], before the
        final norm (EAGLE-style draft heads read these features), after the outputs of the
        `feature_layers` when a head reads those too ([B, T, (len + 1) * dim]: low and mid layers
        say what the last one has already turned into a prediction). No LM head here: the caller
        picks the rows it needs first, because the LM head is the most expensive matmul."""
        if self.token_pass is not None:
            return self._forward_tokens(tokens, batch, caches)
        B, T = tokens.shape
        rows = batch.rows
        x = self.embed_tokens(tokens if rows is None else tokens.reshape(-1).index_select(0, rows))  # [B, T, dim] or [N, dim]
        rope = {}
        for kind in self._rope_kinds:
            cos_t, sin_t = self.rope_tables(kind, batch.ctx, x.device, x.dtype)
            rope[kind] = (cos_t[batch.rope_pos].unsqueeze(2), sin_t[batch.rope_pos].unsqueeze(2))  # [B, T, 1, hd]
        kept = []
        with sdpa_kernel(_NOT_CUDNN) if x.is_cuda else contextlib.nullcontext():
            for i, (layer, (kc, vc)) in enumerate(zip(self.layers, caches)):
                cos, sin = rope[layer.rope_kind]
                x = layer(x, cos, sin, LayerKV(kc, vc, batch), batch.mask_for(layer.window), rows)
                if i in self.feature_layers:
                    kept.append(x)
        return _padded(_led_by(kept, x), rows, B, T)

    def use_token_pass(self, compiled: bool) -> None:
        """Run every pass over the batch's real tokens only, row by row (models.token_pass):
        batch-invariant, and compiled when `compiled`."""
        from specdec.models.token_pass import TokenPass

        self.token_pass = TokenPass(self, compiled)

    def _forward_tokens(self, tokens: Tensor, batch: BatchIndex, caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        B, T = tokens.shape
        flat = tokens.reshape(-1) if batch.rows is None else tokens.reshape(-1)[batch.rows]
        pos = batch.meta[:, 1]
        rope = {}
        for kind in self._rope_kinds:
            cos_t, sin_t = self.rope_tables(kind, batch.ctx, tokens.device, self.embed.weight.dtype)
            rope[kind] = (cos_t[pos], sin_t[pos])
        return _padded(self.token_pass(flat, batch.meta, rope, caches), batch.rows, B, T)

    def token_forward(self, tokens: Tensor, meta: Tensor, rope: dict[str, tuple[Tensor, Tensor]],
                      caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """The pass over N real tokens [N] of a ragged batch: meta [N, 4] is each one's (slot,
        position, row, parent) (token_pass.TokenKV), rope[kind] its (cos, sin) [N, hd]. Returns
        pre-norm hidden states [N, dim] (after the feature layers' outputs, as `forward`)."""
        from specdec.models.token_pass import TokenKV

        x = self.embed_tokens(tokens)
        rope = {kind: (cos.unsqueeze(1), sin.unsqueeze(1)) for kind, (cos, sin) in rope.items()}  # [N, 1, hd]
        op, kept = self.token_pass.attention, []
        for i, (layer, (kc, vc)) in enumerate(zip(self.layers, caches)):
            cos, sin = rope[layer.rope_kind]
            x = layer(x, cos, sin, TokenKV(kc, vc, meta, op), None)
            if i in self.feature_layers:
                kept.append(x)
        return _led_by(kept, x)

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm and LM head over pre-norm hidden states [..., dim] -> [..., V] fp32 (the
        last layer's part of a row that carries feature layers too)."""
        if hidden.shape[-1] != self.args.dim:
            hidden = hidden[..., -self.args.dim :].contiguous()
        y = self.lm_head(self.norm(hidden)).float()
        cap = self.args.final_softcap
        if cap is not None:
            y = torch.tanh(y / cap) * cap
        extra = self.logits_size - y.shape[-1]
        return y if extra <= 0 else torch.nn.functional.pad(y, (0, extra), value=float("-inf"))

    def pad_vocab(self, size: int) -> None:
        """Return logits over `size` ids when that is more than ours (a draft for a verifier with a
        wider LM head); the ids past our vocabulary get -inf, and read as our last one when fed."""
        self.logits_size = max(size, self.args.vocab_size)

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Copy weights from an HF state dict of this family (q/k/v and gate/up fused here)."""
        a = self.args

        def g(name: str) -> Tensor:
            if name not in sd:
                raise KeyError(f"the checkpoint has no {name!r} ({type(self).__name__} expects it)")
            return sd[name]

        self.embed.weight.copy_(g("model.embed_tokens.weight"))
        self.norm.weight.copy_(a.norm_weight(g("model.norm.weight")))
        self.lm_head.weight_t.copy_(g("model.embed_tokens.weight" if a.tie_embeddings else "lm_head.weight").t())
        for i, blk in enumerate(self.layers):
            blk.load_hf(g, f"model.layers.{i}.")


def _led_by(kept: list[Tensor], x: Tensor) -> Tensor:
    """The last layer's rows x after the feature layers' outputs kept on the way (forward)."""
    return torch.cat([*kept, x], -1) if kept else x


def _padded(x: Tensor, rows: Tensor | None, B: int, T: int) -> Tensor:
    """A pass's real tokens' states ([N, dim], at `rows` of the flattened batch) back to [B, T, dim],
    padding as zeros; x itself when every place is a real token."""
    if rows is None:
        return x.view(B, T, -1)
    return x.new_zeros(B * T, x.shape[-1]).index_copy_(0, rows, x).view(B, T, -1)
