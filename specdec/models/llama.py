"""Llama 1-3.x (every RoPE scaling type in rope.py) and Mistral (a sliding window when its config
sets one): pre-norm blocks, SwiGLU MLP.

Weights come from an HF `LlamaForCausalLM`-shaped state dict; SmolLM2 is one of these. The names
the rest of specdec imports from here (ModelArgs, Transformer, Linear, RMSNorm, BatchIndex) stay
importable from this module."""
from __future__ import annotations

import torch
from torch import Tensor

from specdec.models.args import ModelArgs
from specdec.models.decoder import Decoder
from specdec.models.layers import BatchIndex, DecoderBlock, LayerKV, Linear, RMSNorm, dnn_pack

__all__ = ["ModelArgs", "Transformer", "Block", "Linear", "RMSNorm", "BatchIndex", "LayerKV", "dnn_pack"]


class Block(DecoderBlock):
    """x += attn(norm(x)); x += mlp(norm(x))."""

    def __init__(self, a: ModelArgs, layer: int = 0):
        super().__init__(a, layer)
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.mlp_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: LayerKV, mask: Tensor | None,
                rows: Tensor | None = None) -> Tensor:
        """x: [B, T, dim], or a ragged batch's real tokens [N, dim] (see DecoderBlock.attend)."""
        x = x + self.attend(self.attn_norm(x), cos, sin, kv, mask, rows)
        return x + self.mlp(self.mlp_norm(x))

    @torch.no_grad()
    def load_hf(self, g, p: str) -> None:
        super().load_hf(g, p)
        self.attn_norm.weight.copy_(self.a.norm_weight(g(p + "input_layernorm.weight")))
        self.mlp_norm.weight.copy_(self.a.norm_weight(g(p + "post_attention_layernorm.weight")))


class Transformer(Decoder):
    """Llama and Mistral; the base of the other pre-norm families (Qwen, Phi-3)."""

    block_cls = Block
