"""Weight-only int4 (gpt-fast's int4 path): a 1-token pass reads its weights once, so bytes per
weight set its speed, and the default verifier ships as a 4-bit GGUF (Q4_1: per 32 weights a
scale d and a minimum m, w = d q + m, q in 0..15) anyway.

`quantize_model` picks the kernel: specdec's own (models.kernels: int8 activations, as llama.cpp
computes Q4_1, nearly flat in rows) where it builds, else torch's `_weight_int4pack_mm_for_cpu`
below (bfloat16 activations; its cost grows with each row). Either computes each row of a matmul
on its own, which is what keeps speculative greedy output equal to plain greedy output in this
precision (tests/test_quant.py, tests/test_kernels.py).

Weights are quantised the way Q4_1 stores them, asymmetric per group of 32 along the input: a
de-quantised Q4_1 group has its minimum at q = 0 and its maximum at q = 15, so re-quantising it
finds the same q, d and m. torch's kernel keeps d and m + 8 d (its zero point) in bfloat16, the
activations' dtype; with float32 activations it has no fast path (5-40x slower than float32
F.linear here)."""
from __future__ import annotations

import torch
from torch import Tensor

from specdec.models import kernels

GROUP = 32  # weights per scale and zero point, as in GGUF's Q4_1
ACT_DTYPE = torch.bfloat16  # activations (and the KV cache) of an int4 model


MIN_PARAMS = 10_000_000  # 'auto' quantises models this big; tiny test models stay float32


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: where torch's int4 kernel with bfloat16 activations is fast."""
    from specdec.models.layouts import cpu_info

    return bool({"avx512_bf16", "amx_bf16"} & cpu_info()[1])


def pays(model: torch.nn.Module) -> bool:
    """Whether dtype 'auto' runs this (CPU, float32-loaded) model in int4: for models big enough
    that reading their weights dominates a pass, where specdec's kernels build with a SIMD path
    (AVX512-VNNI or AVX2: their AVX2 path, built here with AVX-512 off, ran the default model's
    1-token pass in 15.4 ms against float32's 35.2) or else torch's int4 kernel has fast bfloat16."""
    from specdec.models import kernels

    if next(model.parameters()).device.type != "cpu" or sum(p.numel() for p in model.parameters()) < MIN_PARAMS:
        return False
    return (kernels.load() and kernels.isa() != "scalar") or (available() and cpu_has_bf16())


def quantize(weight: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor]:
    """weight [out, in] -> (int4-packed weight, scales and zero points [in / group, out, 2])."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"int4 needs input widths divisible by {group}; this weight is [{n}, {k}]")
    w = weight.detach().float().reshape(n, k // group, group)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-10)  # a constant group: any scale, q = 0
    q = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # the kernel de-quantises as (q - 8) * scale + zero
    sz = torch.stack([scale.squeeze(-1).t(), (lo + 8 * scale).squeeze(-1).t()], dim=-1)
    return packed, sz.contiguous().to(ACT_DTYPE)


def matmul(x: Tensor, packed: Tensor, scales_zeros: Tensor, group: int = GROUP) -> Tensor:
    """x [..., in] (bfloat16) times the quantised weight's transpose -> [..., out]."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).contiguous(), packed, group,
                                                   scales_zeros)
    return y.view(*x.shape[:-1], y.shape[-1])


def quantize_model(model: torch.nn.Module, compiled: bool = True) -> int:
    """Quantise the decoder blocks' Linears in place to 4 bits (specdec's kernel where it builds,
    else torch's), the LM head to 8 bits where specdec's kernel serves it (else it stays
    bfloat16: int4 groups of 32 re-quantising it cost answers their quality), and make the
    model's passes batch-invariant (models.token_pass; compiled unless `compiled` is False).
    Returns how many block Linears."""
    from specdec.models.layers import DecoderBlock, Linear

    if not available():
        raise RuntimeError("dtype 'int4' needs torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu), "
                           "which this torch build lacks")
    n = 0
    for block in model.modules():
        if isinstance(block, DecoderBlock):
            for m in block.modules():
                if isinstance(m, Linear):
                    m.quantize_int4()
                    n += 1
    if kernels.load() and kernels.fits(model.lm_head.weight):
        model.lm_head.quantize_int8()  # the GGUF's own Q8_0 layout: half bf16's bytes
    model.use_token_pass(compiled)
    return n
