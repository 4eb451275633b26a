"""Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm, explicit head_dim): Llama's
pre-norm blocks with those switches. Sliding layers follow the config's layer_types when
use_sliding_window is set."""
from __future__ import annotations

from dataclasses import replace

from specdec.models.args import ModelArgs
from specdec.models.llama import Transformer


class Qwen2(Transformer):
    @classmethod
    def hf_args(cls, cfg) -> ModelArgs:
        # Qwen2 always has q/k/v biases, says so only through its model type, and has no o_proj bias
        return replace(ModelArgs.from_hf(cfg), attention_bias=True, out_bias=False)


class Qwen3(Transformer):
    @classmethod
    def hf_args(cls, cfg) -> ModelArgs:
        return replace(ModelArgs.from_hf(cfg), qk_norm=True)
