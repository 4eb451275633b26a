"""Per-shape choice of matmul kernel for the few-row CPU matmuls of decoding and verification.

For every distinct Linear shape the model has, time x @ W_t, F.linear(x, W), (where MKL is
there) MKL's packed GEMM and (where oneDNN is there) oneDNN's packed linear at each row count a
pass can have (1 ... 9 rows for one sequence's K+1 tokens, more for batches) and tell each
Linear which to use. Run it on the thread (and thread count) that will do the compute: OpenMP
and BLAS pick kernels per thread team. Which wins is the machine's: on Intel Xeon VMs MKL's
packed GEMM takes the LM head's 2-9 rows; on an AMD EPYC every MKL kernel costs 3-10x oneDNN's
there.

An MKL-packed weight serves exactly one row count and costs about one more resident copy of the
weight; a oneDNN-packed one serves every row count for one copy. Copies are limited to a byte
budget, filled from the fewest rows up (bs 1 verification at small K is the common case), and
MKL packing to PACK_ROWS.

Timing every shape takes ~30 s on two cores, so decisions are kept in a small JSON file keyed by
what they depend on (CPU, thread count, torch, shape, dtype): a replica's later starts reuse them.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.models.llama import Linear, dnn_pack

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)  # row counts timed; those between follow the one below
PACK_ROWS = (2, 3, 4, 5, 6, 7, 8, 9)  # row counts that may get a packed copy (bs 1, K = 1 .. 8)
MARGIN = 0.95  # a kernel replaces the one before it only for a clear win


def packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def dnn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _cold_time(fns, reps: int = 3) -> float:
    """Seconds per call, each call on a different copy of the weight: in a forward pass the
    weights come from memory, not cache, and hot-cache timings pick the wrong kernel."""
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
def decide(weight_t: torch.Tensor, max_rows: int = 16, cold_bytes: float = 96e6,
           pack_rows: tuple[int, ...] = PACK_ROWS) -> tuple[str, str]:
    """(kernels, unpacked): per row count 0 .. max_rows the fastest kernel ("t", "w", "p" or "d"),
    and the fastest without a packed copy (what a row count falls back to when over the budget)."""
    n_copies = max(2, int(cold_bytes / (weight_t.numel() * weight_t.element_size())))
    wts = [weight_t.clone() for _ in range(n_copies)]
    ws = [w.t().contiguous() for w in wts]
    cpu_f32 = weight_t.device.type == "cpu" and weight_t.dtype == torch.float32
    pack = packing_available() and cpu_f32
    dnns = [dnn_pack(w) for w in ws] if dnn_available() and cpu_f32 else []
    measured: dict[int, tuple[str, str]] = {}
    for m in (r for r in ROWS if r <= max_rows):
        x = torch.randn(m, weight_t.shape[0], dtype=weight_t.dtype, device=weight_t.device)
        t_t = _cold_time([lambda wt=wt: x @ wt for wt in wts])
        t_w = _cold_time([lambda w=w: F.linear(x, w) for w in ws])
        best, t_best = ("w", t_w) if t_w < MARGIN * t_t else ("t", t_t)
        choice, t_choice = best, t_best
        if dnns:
            t_d = _cold_time([lambda d=d: torch.ops.mkldnn._linear_pointwise(x, d, None, "none", [], "") for d in dnns])
            if t_d < MARGIN * t_choice:
                choice, t_choice = "d", t_d
        if pack and m in pack_rows:
            pks = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in ws]
            t_p = _cold_time([lambda p=p, w=w: torch.ops.mkl._mkl_linear(x, p, w, None, m) for p, w in zip(pks, ws)])
            del pks
            choice = "p" if t_p < MARGIN * t_choice else choice
        measured[m] = (choice, best)
    kernels, unpacked = ["t"], ["t"]
    last, last_unpacked = "t", "t"
    for m in range(1, max_rows + 1):
        if m in measured:
            choice, last_unpacked = measured[m]
            last = choice if choice != "p" else last_unpacked  # what serves the rows up to the next timed count
        else:
            choice = last  # untimed row counts follow the choice below them (an MKL packing's fallback)
        kernels.append(choice)
        unpacked.append(last_unpacked)
    if kernels[-1] == "p":  # the last entry also serves more rows: never an exact-rows packing
        kernels[-1] = unpacked[-1]
    return "".join(kernels), "".join(unpacked)


def cpu_info() -> tuple[str, set[str]]:
    """The CPU's model name and feature flags (from /proc/cpuinfo; the platform's name and no
    flags where it cannot be read)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor(), set()
    name = next((x.split(":", 1)[1].strip() for x in info if x.startswith("model name")), platform.processor())
    flags = next((x.split(":", 1)[1] for x in info if x.startswith("flags")), "")
    return name, set(flags.split())


def machine_key() -> str:
    """What a timing depends on besides the shape: the CPU (model and feature flags: a VM of the
    same name may lack AMX), the thread team's size and torch's kernels."""
    name, flags = cpu_info()
    cpu = f"{name} {hashlib.sha1(' '.join(sorted(flags)).encode()).hexdigest()[:8]}" if flags else name
    return f"{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def _read_cache(path: Path | None) -> dict:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):  # missing or half-written by a crashed start: time again
        return {}


def _write_cache(path: Path, entries: dict) -> None:
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):  # replicas starting together each add their shapes
        merged = {**_read_cache(path), **entries}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
        os.replace(tmp, path)


def tune_layouts(model: torch.nn.Module, max_rows: int = 16, cold_bytes: float = 96e6,
                 pack_budget_bytes: float | None = None, cache: Path | None = None) -> dict:
    """Set every Linear's kernel table (CPU only); returns the tables by weight shape.
    Packed copies are kept from the fewest rows up while they fit pack_budget_bytes
    (default: SPECDEC_PACK_GB, 3 GB): an MKL one per row count, a oneDNN one per weight.
    With a cache file, shapes timed before on this machine are not timed again."""
    if pack_budget_bytes is None:
        pack_budget_bytes = float(os.environ.get("SPECDEC_PACK_GB", "3")) * 1e9
    mods = [m for m in model.modules() if isinstance(m, Linear) and m.weight_t.device.type == "cpu"]
    key = lambda m: (tuple(m.weight_t.shape), m.weight_t.dtype)  # noqa: E731
    cached, timed, machine = _read_cache(cache), {}, machine_key()
    tables = {}
    for mod in mods:
        k = key(mod)
        if k in tables:
            continue
        name = f"{machine}|{'x'.join(map(str, k[0]))}|{k[1]}|rows={max_rows}|cold={cold_bytes:g}"
        if name in cached:
            tables[k] = tuple(cached[name])
        else:
            tables[k] = timed[name] = decide(mod.weight_t.detach(), max_rows, cold_bytes)
    if cache is not None and timed:
        try:
            _write_cache(cache, timed)
        except OSError:  # a read-only home: the next start times again, nothing worse
            pass
    bytes_per_key = {k: 0 for k in tables}
    for mod in mods:
        bytes_per_key[key(mod)] += mod.weight_t.numel() * mod.weight_t.element_size()
    chosen = {k: list(kern) for k, (kern, _) in tables.items()}
    used, dnn_paid = 0.0, set()
    for m in range(1, max_rows + 1):  # fill the budget from the fewest rows up
        for k, (kern, unpacked) in tables.items():
            if kern[m] not in ("p", "d") or (kern[m] == "d" and k in dnn_paid):
                continue  # no copy, or this weight's oneDNN copy, which serves every row count, is paid
            if used + bytes_per_key[k] <= pack_budget_bytes:
                used += bytes_per_key[k]
                if kern[m] == "d":
                    dnn_paid.add(k)
            else:
                chosen[k][m] = unpacked[m]
    decided = {k: "".join(v) for k, v in chosen.items()}
    for mod in mods:
        mod.set_kernels(decided[key(mod)])
    return decided


def describe(decided: dict) -> dict[str, str]:
    """{"576x49152": "tww ppp..."}: the kernel per row count from 1 row on, by weight shape."""
    return {"x".join(map(str, k[0])): v[1:] for k, v in decided.items()}


def maybe_tune(model: torch.nn.Module, min_params: int = 10_000_000) -> dict:
    """tune_layouts for real models on CPU; tiny test models are not worth the seconds.
    SPECDEC_TUNE_LAYOUTS=0 turns it off (x @ W_t everywhere); =fresh deletes the cache file
    ($SPECDEC_HOME/layouts.json) first, so every shape is timed again."""
    mode = os.environ.get("SPECDEC_TUNE_LAYOUTS", "1")
    if mode == "0" or next(model.parameters()).device.type != "cpu":
        return {}
    if sum(x.numel() for x in model.parameters()) < min_params:
        return {}
    if any(getattr(m, "quantized", False) for m in model.modules()):
        return {}  # int4 has one kernel for every row count (models.quant)
    from specdec.models.default import specdec_home

    cache = specdec_home() / "layouts.json"
    if mode == "fresh":
        cache.unlink(missing_ok=True)
    return tune_layouts(model, cache=cache)
