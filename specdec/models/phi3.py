"""Phi-3 (mini/medium, without LongRoPE): Llama's blocks with HF's already fused qkv_proj and
gate_up_proj weights, and a sliding window over every layer when the config sets one."""
from __future__ import annotations

import torch

from specdec.models.llama import Block, Transformer


class Phi3Block(Block):
    @torch.no_grad()
    def load_hf(self, g, p: str) -> None:
        self.wqkv.weight_t.copy_(g(p + "self_attn.qkv_proj.weight").t())  # rows: q, k, v
        self.wo.weight_t.copy_(g(p + "self_attn.o_proj.weight").t())
        self.w13.weight_t.copy_(g(p + "mlp.gate_up_proj.weight").t())  # rows: gate, up
        self.w2.weight_t.copy_(g(p + "mlp.down_proj.weight").t())
        self.attn_norm.weight.copy_(g(p + "input_layernorm.weight"))
        self.mlp_norm.weight.copy_(g(p + "post_attention_layernorm.weight"))


class Phi3(Transformer):
    block_cls = Phi3Block
