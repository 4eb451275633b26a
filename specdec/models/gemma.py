"""Gemma 2 and Gemma 3 (text): (1 + w) RMSNorms (folded into the weights at load), embeddings
scaled by sqrt(dim), GeGLU, norms before and after both attention and MLP, a softmax scale from
query_pre_attn_scalar, tanh soft-capping of attention scores and logits where the config sets it,
and sliding-window layers alternating with global ones (Gemma 3's with their own RoPE base)."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from specdec.models.args import ModelArgs, UnsupportedModelError
from specdec.models.decoder import Decoder
from specdec.models.layers import DecoderBlock, LayerKV, RMSNorm

ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}  # HF name -> ours


class GemmaBlock(DecoderBlock):
    """x += post_norm(attn(norm(x))); x += post_norm(mlp(norm(x)))."""

    def __init__(self, a: ModelArgs, layer: int = 0):
        super().__init__(a, layer)
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.post_attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.mlp_norm = RMSNorm(a.dim, a.norm_eps)
        self.post_mlp_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: LayerKV, mask: Tensor | None,
                rows: Tensor | None = None) -> Tensor:
        x = x + self.post_attn_norm(self.attend(self.attn_norm(x), cos, sin, kv, mask, rows))
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))

    @torch.no_grad()
    def load_hf(self, g, p: str) -> None:
        super().load_hf(g, p)
        w = lambda name: self.a.norm_weight(g(p + name))  # noqa: E731
        self.attn_norm.weight.copy_(w("input_layernorm.weight"))
        self.post_attn_norm.weight.copy_(w("post_attention_layernorm.weight"))
        self.mlp_norm.weight.copy_(w("pre_feedforward_layernorm.weight"))
        self.post_mlp_norm.weight.copy_(w("post_feedforward_layernorm.weight"))


class Gemma(Decoder):
    block_cls = GemmaBlock

    @classmethod
    def hf_args(cls, cfg) -> ModelArgs:
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedModelError("Gemma with use_bidirectional_attention (an encoder) is not a causal LM")
        act = getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"Gemma hidden_activation {act!r} is not supported")
        return replace(ModelArgs.from_hf(cfg), act=ACTIVATIONS[act], norm_offset=1.0, embed_scale=cfg.hidden_size**0.5,
                       attn_scale=cfg.query_pre_attn_scalar**-0.5, attn_softcap=cfg.attn_logit_softcapping,
                       final_softcap=cfg.final_logit_softcapping, qk_norm=cfg.model_type.startswith("gemma3"),
                       tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)))
