"""Per-shape choice of weight layout for the few-row CPU matmuls of decoding and verification.

For every distinct Linear shape the model has, time x @ W_t against F.linear(x, W) at each row
count a pass can have (1 ... 9 rows for one sequence's K+1 tokens, more for batches) and tell
each Linear which to use. Run it on the thread (and thread count) that will do the compute:
OpenMP and BLAS pick kernels per thread team."""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from specdec.models.llama import Linear

ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)  # row counts timed; those between follow the one below


def _cold_time(fns, reps: int = 3) -> float:
    """Seconds per call, each call on a different copy of the weight: in a forward pass the
    weights come from memory, not cache, and hot-cache timings pick the wrong layout."""
    for f in fns[:2]:
        f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for f in fns:
            f()
        best = min(best, (time.perf_counter() - t) / len(fns))
    return best


@torch.no_grad()
def decide(weight_t: torch.Tensor, max_rows: int = 16, cold_bytes: float = 96e6) -> tuple[bool, ...]:
    """use_w[rows] for rows = 0 .. max_rows: True where the [out, in] layout is faster."""
    n_copies = max(2, int(cold_bytes / (weight_t.numel() * weight_t.element_size())))
    wts = [weight_t.clone() for _ in range(n_copies)]
    ws = [w.t().contiguous() for w in wts]
    measured = {}
    for m in (r for r in ROWS if r <= max_rows):
        x = torch.randn(m, weight_t.shape[0], dtype=weight_t.dtype, device=weight_t.device)
        t_w = _cold_time([lambda w=w: F.linear(x, w) for w in ws])
        t_t = _cold_time([lambda wt=wt: x @ wt for wt in wts])
        measured[m] = t_w < 0.95 * t_t  # switch only for a clear win
    out, last = [False], False
    for m in range(1, max_rows + 1):
        last = measured.get(m, last)
        out.append(last)
    return tuple(out)


def tune_layouts(model: torch.nn.Module, max_rows: int = 16, cold_bytes: float = 96e6) -> dict:
    """Set every Linear's layout table (CPU only); returns the decisions by weight shape."""
    decided: dict = {}
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.weight_t.device.type == "cpu":
            key = (tuple(mod.weight_t.shape), mod.weight_t.dtype)
            if key not in decided:
                decided[key] = decide(mod.weight_t.detach(), max_rows, cold_bytes)
            mod.set_layouts(decided[key])
    return decided


def maybe_tune(model: torch.nn.Module, min_params: int = 10_000_000) -> dict:
    """tune_layouts for real models on CPU; tiny test models are not worth the seconds.
    SPECDEC_TUNE_LAYOUTS=0 turns it off (x @ W_t everywhere)."""
    if os.environ.get("SPECDEC_TUNE_LAYOUTS", "1") == "0" or next(model.parameters()).device.type != "cpu":
        return {}
    if sum(x.numel() for x in model.parameters()) < min_params:
        return {}
    return tune_layouts(model)
