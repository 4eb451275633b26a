"""specdec's CPU kernels, both batch-invariant by construction (a row's result is bitwise the
same whatever else shares the call):
- wq_matmul.cpp: weight-only-quantised matmul, llama.cpp-style Q4_1 / Q8 weights times activations
  quantised inside the op to int8 per row and group of 32, integer dot products and a fixed float
  fold per row; its cost is nearly flat in the number of rows, where torch's int4 kernel's grows
  with each row (2.6x at 5 rows here), which is what a verify pass of K + 1 tokens pays;
- attention.cpp: a token pass's attention (models.token_pass): runs of a sequence's tokens per key/value
  head and chunk of 128 keys, on AMX-BF16's tile unit where the CPU has it;
- sampling.cpp: a sampled row's probabilities (temperature, top-k, top-p) and its draw, each in a
  pass or two over the vocabulary instead of torch's ~25 ops (specdec.sampling), vectorised by
  the compiler for AVX2 or AVX-512.

`load()` compiles the extension once per (source, torch version, CPU flags) into
$SPECDEC_HOME/kernels/<hash> (default ~/.cache/specdec) and registers torch.ops.specdec_kernels;
it returns False, with the reason logged, where that cannot be done (no compiler or ninja, a failed
build): callers then fall back to torch's own int4 kernel (specdec/models/quant.py)."""
from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

GROUP = 32  # inputs per scale and min
TILE = 16  # output columns per packed tile
SOURCES = [Path(__file__).with_name(f) for f in ("wq_matmul.cpp", "attention.cpp", "sampling.cpp")]
# -fno-trapping-math lets a loop compute on every lane and select after (sampling.cpp's exp on
# AVX2, which has no masked lanes); it changes no result, unlike -ffast-math
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-std=c++17"]

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "reason": str


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return platform.machine() + " " + platform.processor()


def build_for(march: str) -> None:
    """Build the kernels for gcc's -march=`march` rather than this CPU (e.g. haswell: AVX2 without
    AVX-512), to run another machine's paths here; before the first load() of the process."""
    global CFLAGS
    CFLAGS = [f"-march={march}" if f == "-march=native" else f for f in CFLAGS]


def build_dir() -> Path:
    from specdec.models.default import specdec_home

    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in SOURCES), torch.__version__.encode(), _cpu_flags().encode(), " ".join(CFLAGS).encode()):
        key.update(part)
        key.update(b"\0")
    return specdec_home() / "kernels" / key.hexdigest()[:16]


def load(verbose: bool = False) -> bool:
    """Build (once per machine and source) and load the extension; True when its ops are usable."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        try:
            from torch.utils import cpp_extension

            if not hasattr(torch.ops.specdec_kernels, "wq_matmul"):  # not loaded by someone else already
                cpp_extension.verify_ninja_availability()
                path = build_dir()
                path.mkdir(parents=True, exist_ok=True)
                cpp_extension.load(name="specdec_wq_" + path.name, sources=[str(f) for f in SOURCES], extra_cflags=CFLAGS,
                                   extra_ldflags=["-fopenmp"], build_directory=str(path), is_python_module=False,
                                   verbose=verbose)
            _register_fakes()
            _state["ok"], _state["reason"] = True, ""
        except Exception as e:  # no compiler, no ninja, a failed build: the caller falls back
            _state["ok"], _state["reason"] = False, f"{type(e).__name__}: {e}"
            log.warning("specdec kernels unavailable, falling back to torch's int4 kernel: %s", _state["reason"])
        return bool(_state["ok"])


def sampling_fused(t: Tensor) -> bool:
    """Whether sampling.cpp takes this tensor: one on the CPU, where the kernels build with AVX2 or
    AVX-512 (without vectors its loops are no faster than torch's ops)."""
    if t.device.type != "cpu":
        return False
    if "sampling" not in _state:  # decided once: this is asked on every sampled pass
        _state["sampling"] = load() and torch.ops.specdec_sampling.sampling_isa() != "scalar"
    return bool(_state["sampling"])


def unavailable_reason() -> str:
    return str(_state.get("reason", "not loaded yet"))


def isa() -> str:
    """Which path the build compiled: 'avx512-vnni', 'avx2' or 'scalar'."""
    return torch.ops.specdec_kernels.wq_isa()


def _register_fakes() -> None:
    if _state.get("fakes"):
        return

    @torch.library.register_fake("specdec_kernels::wq_matmul")
    def _(x, packed, scales, mins, bits, n):
        torch._check(x.dim() == 2)
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("specdec_attention::attend_tokens")
    def _(q, k, v, k_cache, v_cache, meta, window, scale, softcap):
        return torch.empty_like(q)

    @torch.library.register_fake("specdec_kernels::wq_pack")
    def _(q, bits):
        n, k = q.shape
        return q.new_empty(n // TILE, k // GROUP, GROUP * TILE * bits // 8, dtype=torch.uint8)

    _state["fakes"] = True


def fits(weight: Tensor) -> bool:
    """Whether the kernel takes this [out, in] weight (16 | out, 32 | in)."""
    n, k = weight.shape
    return n % TILE == 0 and k % GROUP == 0


def _check_shape(n: int, k: int) -> None:
    if n % TILE or k % GROUP:
        raise ValueError(f"wq kernels need out features % {TILE} == 0 and in features % {GROUP} == 0; "
                         f"this weight is [{n}, {k}]")


def pack_params(p: Tensor) -> Tensor:
    """Per-(column, group) values [N, K / 32] -> the kernel's layout, fp16 [N / 16, K / 32, 16]."""
    n, g = p.shape
    return p.half().reshape(n // TILE, TILE, g).transpose(1, 2).contiguous()


def unpack_params(p: Tensor) -> Tensor:
    """The kernel's layout [N / 16, K / 32, 16] -> [N, K / 32]."""
    t, g, _ = p.shape
    return p.transpose(1, 2).reshape(t * TILE, g)


def quantize_q4_raw(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """weight [N, K] -> (q uint8 [N, K] in 0..15, d [N, K/32], m [N, K/32]), Q4_1: w ~ d q + m,
    with d and m float16 values (float32 tensors), as GGUF stores them."""
    n, k = weight.shape
    _check_shape(n, k)
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d, m = _fp16((hi - lo) / 15), _fp16(lo)  # as the kernel stores them; q is found against these
    q = torch.where(d > 0, (w - m) / torch.where(d > 0, d, 1), 0).round().clamp(0, 15)  # d = 0: a constant group
    return q.to(torch.uint8).reshape(n, k), d.squeeze(-1), m.squeeze(-1)


def _fp16(x: Tensor) -> Tensor:
    """x rounded to float16's values (kept float32)."""
    return x.half().float()


def quantize_q8_raw(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """weight [N, K] -> (q uint8 [N, K] = round(w / d) + 128, d = amax / 127, m = -128 d), per group of 32."""
    n, k = weight.shape
    _check_shape(n, k)
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    d = _fp16(w.abs().amax(-1, keepdim=True) / 127)
    q = torch.where(d > 0, w / torch.where(d > 0, d, 1), 0).round().clamp(-127, 127) + 128
    return q.to(torch.uint8).reshape(n, k), d.squeeze(-1), (-128 * d).squeeze(-1)


def pack(q: Tensor, d: Tensor, m: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """(q [N, K], d, m [N, K / 32]) -> (packed, scales, mins) for matmul()."""
    return torch.ops.specdec_kernels.wq_pack(q.contiguous(), bits), pack_params(d), pack_params(m)


def quantize_q4(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """weight fp32 [N, K] -> (packed, scales, mins), asymmetric 4-bit per group of 32 as GGUF's Q4_1."""
    return pack(*quantize_q4_raw(weight), 4)


def quantize_q8(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """weight fp32 [N, K] -> (packed, scales, mins), symmetric 8-bit per group of 32 (stored unsigned)."""
    return pack(*quantize_q8_raw(weight), 8)


def dequantize(q: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """(q [N, K], d, m [N, K / 32]) -> w = d q + m, fp32 [N, K]."""
    n, k = q.shape
    return (d.unsqueeze(-1) * q.float().reshape(n, k // GROUP, GROUP) + m.unsqueeze(-1)).reshape(n, k)


def matmul(x: Tensor, packed: Tensor, scales: Tensor, mins: Tensor, bits: int, n: int) -> Tensor:
    """x [..., K] (bfloat16 or float32) times the quantised weight's transpose -> [..., n], x's dtype."""
    y = torch.ops.specdec_kernels.wq_matmul(x.reshape(-1, x.shape[-1]).contiguous(), packed, scales, mins, bits, n)
    return y.view(*x.shape[:-1], n)
