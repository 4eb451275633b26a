"""Rotary-embedding tables for every RoPE type we serve: default, linear, dynamic (NTK), yarn, llama3.

Each type is a formula for the inverse frequencies (what transformers' rope utilities compute for
the same config keys); a table holds cos/sin for positions 0 .. n-1, computed in float64 once.
Dynamic NTK stretches the base as the sequence grows past its original context: a position's
rotation depends only on the position (HF recomputes the frequencies for each new decoding
step's length, so the keys it caches carry exactly these rotations)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

F64 = torch.float64


def rope_table(params: dict, head_dim: int, n: int) -> tuple[Tensor, Tensor]:
    """(cos, sin), each [n, head_dim] float64, for positions 0 .. n-1."""
    pos = torch.arange(n, dtype=F64)
    kind = params["rope_type"]
    if kind == "dynamic":
        freqs = pos.unsqueeze(1) * dynamic_inv_freq(params, head_dim, pos)  # [n, hd/2]
        scale = 1.0
    else:
        inv, scale = INV_FREQ[kind](params, head_dim)
        freqs = torch.outer(pos, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def default_inv_freq(params: dict, head_dim: int, base: float | Tensor | None = None) -> Tensor:
    base = params["rope_theta"] if base is None else base
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=F64) / head_dim))


def _default(params: dict, head_dim: int) -> tuple[Tensor, float]:
    return default_inv_freq(params, head_dim), 1.0


def _linear(params: dict, head_dim: int) -> tuple[Tensor, float]:
    """Position interpolation: positions divided by the factor (the same as dividing frequencies)."""
    return default_inv_freq(params, head_dim) / params["factor"], 1.0


def _llama3(params: dict, head_dim: int) -> tuple[Tensor, float]:
    """Llama 3.1: low frequencies (wavelength past orig / low_freq_factor) are interpolated by the
    factor, high ones (shorter than orig / high_freq_factor) kept, those between blended."""
    inv = default_inv_freq(params, head_dim)
    factor, orig = params["factor"], params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > orig / low, inv / factor, blended)
    return torch.where(wavelen < orig / high, inv, out), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict, head_dim: int) -> tuple[Tensor, float]:
    """YaRN: per dimension, extrapolate (keep) the fast-rotating frequencies and interpolate the slow
    ones, with a linear ramp between the dimensions that make beta_fast and beta_slow turns over
    the original context; cos/sin are scaled by the attention factor."""
    base, factor = params["rope_theta"], params["factor"]
    orig = params["original_max_position_embeddings"]
    attn = params.get("attention_factor")
    if attn is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                else _yarn_mscale(factor))

    def dim_of(turns: float) -> float:  # the dimension whose frequency makes `turns` turns over orig
        return head_dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(params.get("beta_fast") or 32), dim_of(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=F64) - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: interpolate
    inv = default_inv_freq(params, head_dim)
    return inv * (1 - ramp) + inv / factor * ramp, float(attn)


def dynamic_inv_freq(params: dict, head_dim: int, pos: Tensor) -> Tensor:
    """[n, hd/2]: position p's frequencies with the base stretched for a sequence of p + 1 tokens
    (unchanged up to the original context)."""
    orig, factor = params["original_max_position_embeddings"], params["factor"]
    seq_len = torch.clamp(pos + 1, min=orig)
    base = params["rope_theta"] * ((factor * seq_len / orig) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base.unsqueeze(1) ** (torch.arange(0, head_dim, 2, dtype=F64) / head_dim))


INV_FREQ = {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn}
