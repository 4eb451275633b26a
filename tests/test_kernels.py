"""The weight-only-quantised matmul kernel (specdec/models/kernels): it computes the Q4_1 / Q8 x
int8-activation math it documents, a row's result is bitwise independent of the rows sharing the
call, Q4_1-exact weights survive quantisation, and the op sits inside a torch.compile graph."""
import pytest
import torch

from specdec.models import kernels

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"wq kernels unavailable: {kernels.unavailable_reason()}")


def quantize_acts(x: torch.Tensor):
    """The op's activation quantisation: per row and group of 32, s = max|x| / 127 (fp32),
    xq = round-half-even(x / s), s = 0 -> xq = 0."""
    m, k = x.shape
    xg = x.float().reshape(m, k // 32, 32)
    s = xg.abs().amax(-1, keepdim=True) / 127
    xq = torch.where(s > 0, (xg / torch.where(s > 0, s, 1)).round(), 0).clamp(-127, 127)
    return xq, s


def reference(x, q, d, m):
    """float64: sum over groups of d s sum(q xq) + m s sum(xq), and the magnitude its float32 fold
    rounds at: every product's, since d sum(q xq) and m sum(xq) can cancel (a group of 8-bit
    weights centred on zero) and leave the rounding of each larger than their sum."""
    xq, s = quantize_acts(x)
    n, k = q.shape
    qg = q.double().reshape(n, k // 32, 32)
    isum = torch.einsum("mgk,ngk->mng", xq.double(), qg)
    xsum = xq.double().sum(-1)  # [M, G]
    dq, mx = d.double()[None] * isum, m.double()[None] * xsum[:, None, :]
    sg = s.double().squeeze(-1)[:, None, :]
    return (sg * (dq + mx)).sum(-1), (sg.abs() * (dq.abs() + mx.abs())).sum(-1)


def make(bits, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    raw = kernels.quantize_q4_raw(w) if bits == 4 else kernels.quantize_q8_raw(w)
    return raw, kernels.pack(*raw, bits)


def check(bits, n, k, ms, dtype, seed=0):
    raw, (packed, scales, mins) = make(bits, n, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(max(ms), k, generator=g).to(dtype)
    want_all, mag_all = reference(x, *raw)  # the reference's rows are independent
    for mm in ms:
        got = kernels.matmul(x[:mm], packed, scales, mins, bits, n)
        assert got.dtype == dtype and got.shape == (mm, n)
        want, mag = want_all[:mm], mag_all[:mm]
        # fp32 accumulation over K / 32 groups; bfloat16 output rounding on top
        tol = (2e-6 * (k // 32) ** 0.5 + 1e-6) * mag + (4e-3 * want.abs() if dtype == torch.bfloat16 else 0)
        err = (got.double() - want).abs()
        assert (err <= tol + 1e-30).all(), f"max err {err.max().item()} (bits={bits} n={n} k={k} m={mm} {dtype})"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(16, 64), (960, 576), (3072, 576), (576, 1536), (16, 1536)])
def test_matches_the_reference_math(bits, dtype, n, k):
    check(bits, n, k, [1, 2, 3, 4, 5, 6, 7, 8, 9, 16] if n * k <= 960 * 576 else [1, 5, 9, 16], dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(48, 64), (960, 576), (144, 1536)])
def test_a_rows_result_is_bitwise_independent_of_the_rows_beside_it(bits, dtype, n, k):
    _, (packed, scales, mins) = make(bits, n, k)
    x = (torch.randn(16, k) * torch.logspace(-3, 2, 16)[:, None]).to(dtype)
    alone = torch.cat([kernels.matmul(x[i : i + 1], packed, scales, mins, bits, n) for i in range(16)])
    for mm in range(1, 17):
        for start in {0, 16 - mm}:
            got = kernels.matmul(x[start : start + mm], packed, scales, mins, bits, n)
            assert torch.equal(got, alone[start : start + mm]), f"m={mm} start={start}"


@pytest.mark.parametrize("n,k", [(48, 64), (960, 576), (144, 1536)])
def test_amx_and_vnni_rows_give_the_same_bits(n, k):
    """Several rows of 8-bit weights go through AMX where the machine has it; its sums are exact
    and its fold is VNNI's, so either path gives the same bits (and the same as one row alone)."""
    if "amx" not in torch.ops.specdec_kernels.wq_isa():
        pytest.skip("no AMX-INT8 here")
    _, (packed, scales, mins) = make(8, n, k)
    x = (torch.randn(16, k) * torch.logspace(-3, 2, 16)[:, None]).bfloat16()
    before = torch.ops.specdec_kernels.wq_allow_amx(False)
    try:
        vnni = [kernels.matmul(x[:mm], packed, scales, mins, 8, n) for mm in range(2, 17)]
    finally:
        torch.ops.specdec_kernels.wq_allow_amx(before)
    for mm, want in zip(range(2, 17), vnni):
        assert torch.equal(kernels.matmul(x[:mm], packed, scales, mins, 8, n), want), f"m={mm}"


def test_q4_1_exact_weights_round_trip():
    g = torch.Generator().manual_seed(0)
    n, k = 64, 128
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()  # GGUF keeps d and m in fp16
    m = (-8 * d + torch.randn(n, k // 32, 1, generator=g) * 1e-3).half().float()
    w = (d * q + m).reshape(n, k)
    q2, d2, m2 = kernels.quantize_q4_raw(w)
    assert torch.equal(q2, q.reshape(n, k).to(torch.uint8))
    assert torch.allclose(kernels.dequantize(q2, d2, m2), w, rtol=0, atol=1e-6)
    packed, scales, mins = kernels.pack(q2, d2, m2, 4)
    assert torch.equal(kernels.unpack_params(scales).float(), d2) and torch.equal(kernels.unpack_params(mins).float(), m2)
    x = torch.randn(3, k, generator=g)
    got = kernels.matmul(x, packed, scales, mins, 4, n)
    assert torch.allclose(got, x @ w.t(), rtol=2e-2, atol=2e-2)  # int8 activations: ~1% error


def test_q8_weights_dequantise_close():
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(0))
    q, d, m = kernels.quantize_q8_raw(w)
    assert int(q.min()) >= 1 and int(q.max()) <= 255
    assert (kernels.dequantize(q, d, m) - w).abs().max() <= d.max() / 2 + 1e-6


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_and_constant_groups(bits):
    n, k = 32, 128
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    w[:, :32] = 0.0  # all-zero weight group
    w[:, 32:64] = 0.25  # all-equal weight group
    raw = kernels.quantize_q4_raw(w) if bits == 4 else kernels.quantize_q8_raw(w)
    packed, scales, mins = kernels.pack(*raw, bits)
    # exact for q4 (q = 0, m = the value); for q8 up to the fp16 scale's rounding (as GGUF's Q8_0)
    assert torch.allclose(kernels.dequantize(*raw)[:, :64], w[:, :64], atol=1e-6 if bits == 4 else 2e-4)
    x = torch.randn(4, k, generator=g)
    x[0] = 0.0  # all-zero row
    x[1, :32] = 0.0  # all-zero activation group
    x[2, :32] = -1.5  # all-equal activation groups
    x[2, 64:96] = 3.0
    got = kernels.matmul(x, packed, scales, mins, bits, n)
    want, mag = reference(x, *raw)
    assert torch.equal(got[0], torch.zeros(n))
    assert ((got.double() - want).abs() <= 1e-5 * mag + 1e-7).all()
    alone = torch.cat([kernels.matmul(x[i : i + 1], packed, scales, mins, bits, n) for i in range(4)])
    assert torch.equal(got, alone)


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="% 16"):
        kernels.quantize_q4(torch.randn(20, 64))
    with pytest.raises(ValueError, match="% 32"):
        kernels.quantize_q8(torch.randn(16, 40))
    packed, scales, mins = kernels.quantize_q4(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.specdec_kernels.wq_matmul(torch.randn(1, 48), packed, scales, mins, 4, 16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.specdec_kernels.wq_matmul(torch.randn(1, 64), packed, scales, mins, 4, 8)
    with pytest.raises(RuntimeError, match="expected"):
        torch.ops.specdec_kernels.wq_matmul(torch.randn(1, 64), packed, scales, mins, 8, 16)


def test_inside_a_compiled_graph():
    packed, scales, mins = kernels.quantize_q4(torch.randn(64, 96))

    def f(x):
        return kernels.matmul(x * 2, packed, scales, mins, 4, 64) * 0.5  # exact scalings: same bits

    x = torch.randn(3, 96).bfloat16()
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), f(x))


# -- attention (attention.cpp): a token pass's per-token attention ----------------------------------

def _attention_case(n_tokens: int, window: int = 0, softcap: float = 0.0, seed: int = 0, hd: int = 64,
                    start: int = 100, length: int = 130):
    g = torch.Generator().manual_seed(seed)
    slots, heads, kv_heads = 3, 6, 2
    k_cache = torch.randn(slots, kv_heads, length, hd, generator=g).bfloat16()
    v_cache = torch.randn(slots, kv_heads, length, hd, generator=g).bfloat16()
    q = torch.randn(n_tokens, heads, hd, generator=g).bfloat16()
    k = torch.randn(n_tokens, kv_heads, hd, generator=g).bfloat16()
    v = torch.randn(n_tokens, kv_heads, hd, generator=g).bfloat16()
    # two sequences: slot 2 at positions 100.., slot 0 at 7..
    meta = chain_meta([(2, start + i) for i in range(n_tokens - n_tokens // 2)] + [(0, 7 + i) for i in range(n_tokens // 2)])
    return q, k, v, k_cache, v_cache, meta, window, hd**-0.5, softcap


def chain_meta(tokens: list[tuple[int, int]]) -> torch.Tensor:
    """meta [N, 4] of plain tokens (slot, position): each row its position, each token the parent
    of the next one of its slot."""
    rows = []
    for i, (s, p) in enumerate(tokens):
        follows = i > 0 and tokens[i - 1] == (s, p - 1)
        rows.append([s, p, p, i - 1 if follows else -1])
    return torch.tensor(rows)


@pytest.mark.parametrize("window,softcap,hd", [(0, 0.0, 64), (16, 0.0, 64), (0, 30.0, 64), (0, 0.0, 96), (16, 0.0, 256)])
def test_attention_kernel_matches_sdpa_and_writes_the_cache(window, softcap, hd):
    from specdec.models import token_pass

    q, k, v, kc, vc, meta, w, scale, cap = _attention_case(7, window, softcap, hd=hd)
    kc2, vc2 = kc.clone(), vc.clone()
    ours = torch.ops.specdec_attention.attend_tokens(q, k, v, kc, vc, meta, w, scale, cap)
    ref = token_pass.attend_tokens(q, k, v, kc2, vc2, meta, w, scale, cap)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert (ours.float() - ref.float()).abs().max().item() < 0.02


@pytest.fixture(params=[True, False], ids=["tiles", "vectors"])
def tiles(request):
    """Runs' scores and weighted sums on AMX's tile unit where the machine has it, and without."""
    if request.param and torch.ops.specdec_attention.attend_isa() != "amx-bf16":
        pytest.skip("no AMX-BF16 here")
    before = torch.ops.specdec_attention.attend_allow_tiles(request.param)
    yield request.param
    torch.ops.specdec_attention.attend_allow_tiles(before)


@pytest.mark.parametrize("start,length", [(100, 130), (250, 420)])  # 250: runs across chunks of 128 keys
def test_attention_paths_match_sdpa(tiles, start, length):
    from specdec.models import token_pass

    q, k, v, kc, vc, meta, w, scale, cap = _attention_case(21, 0, hd=64, start=start, length=length)
    ours = torch.ops.specdec_attention.attend_tokens(q, k, v, kc.clone(), vc.clone(), meta, w, scale, cap)
    ref = token_pass.attend_tokens(q, k, v, kc.clone(), vc.clone(), meta, w, scale, cap)
    assert (ours.float() - ref.float()).abs().max().item() < 0.02


@pytest.mark.parametrize("n_tokens,window,start,length", [(9, 0, 100, 130), (21, 0, 100, 130), (21, 16, 100, 130),
                                                           (21, 0, 250, 420), (21, 200, 250, 420)])
def test_attention_kernel_is_batch_invariant(tiles, n_tokens, window, start, length):
    """Tokens share key loads in runs of a slot's consecutive tokens (21: runs longer than one task
    takes), and long contexts split into chunks of keys at fixed positions (start 250: runs across
    chunk edges); a token's output is the same bits whatever run it falls in."""
    q, k, v, kc, vc, meta, w, scale, cap = _attention_case(n_tokens, window, start=start, length=length)
    kc_all, vc_all = kc.clone(), vc.clone()
    together = torch.ops.specdec_attention.attend_tokens(q, k, v, kc_all, vc_all, meta, w, scale, cap)
    for i in range(len(q)):
        # last of a shorter call, after the ones of its sequence before it
        prefix = torch.ops.specdec_attention.attend_tokens(q[: i + 1], k[: i + 1], v[: i + 1], kc.clone(), vc.clone(),
                                                            meta[: i + 1], w, scale, cap)
        # alone, its keys already cached: a 1-token decode step
        alone = torch.ops.specdec_attention.attend_tokens(q[i : i + 1], k[i : i + 1], v[i : i + 1], kc_all.clone(),
                                                           vc_all.clone(), chain_meta([tuple(meta[i, :2].tolist())]),
                                                           w, scale, cap)
        assert torch.equal(prefix[i], together[i]) and torch.equal(alone[0], together[i])


TREE = [-1, 0, 1, 0, 3, 1, 2, 6, 7, 8, 9]  # parents of a draft tree's nodes: branches, and a chain past a run's length


def tree_meta(start: int) -> torch.Tensor:
    """meta of TREE's nodes in slot 2, rows from `start`, each node at its depth's position."""
    depth = []
    for p in TREE:
        depth.append(0 if p < 0 else depth[p] + 1)
    return torch.tensor([[2, start + d, start + j, p] for j, (d, p) in enumerate(zip(depth, TREE))])


@pytest.mark.parametrize("window,hd,start", [(0, 64, 100), (8, 64, 100), (0, 96, 100), (8, 48, 100),  # 48: per token
                                             (0, 64, 122)])  # a tree across a chunk edge
def test_attention_over_a_token_tree_gives_each_node_its_paths_bits(tiles, window, hd, start):
    """A tree's nodes sit at the rows after their sequence's (siblings share a position); each
    node's output is the bits of its path computed as a plain sequence, and the Python op agrees."""
    from specdec.models import token_pass

    q, k, v, kc, vc, _, w, scale, cap = _attention_case(len(TREE), window, hd=hd, length=160)
    meta = tree_meta(start)
    kc_t, vc_t, kc_r, vc_r = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    tree = torch.ops.specdec_attention.attend_tokens(q, k, v, kc_t, vc_t, meta, w, scale, cap)
    ref = token_pass.attend_tokens(q, k, v, kc_r, vc_r, meta, w, scale, cap)
    assert torch.equal(kc_t, kc_r) and torch.equal(kc_t[2, :, start : start + len(TREE)], k.transpose(0, 1))
    assert (tree.float() - ref.float()).abs().max().item() < 0.02
    for j in range(len(TREE)):
        path = [j]
        while TREE[path[-1]] >= 0:
            path.append(TREE[path[-1]])
        path = path[::-1]
        plain = torch.ops.specdec_attention.attend_tokens(q[path], k[path], v[path], kc.clone(), vc.clone(),
                                                          chain_meta([(2, start + i) for i in range(len(path))]),
                                                          w, scale, cap)
        assert torch.equal(plain[-1], tree[j]), j


@pytest.mark.parametrize("march", ["icelake-server"])  # AVX-512 without AMX
def test_kernel_sources_compile_for_the_other_cpus(march):
    """These VMs vary (AMD EPYC with AVX2, Intel Xeon with AVX-512 and AMX), and each build takes
    the paths its CPU has: every path must compile, not only this machine's. The AVX2 and scalar
    paths are built whole below (other_build), so only AVX-512 without AMX is checked here."""
    import shutil
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    cxx = shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    cmd = [cxx, "-fsyntax-only", "-std=c++17", f"-march={march}", "-fopenmp", *(f"-isystem{p}" for p in includes),
           *map(str, kernels.SOURCES)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if "bad value" in r.stderr:
        pytest.skip(f"this compiler does not know -march={march}")
    assert r.returncode == 0, r.stderr[-3000:]


OTHER_BUILD = """
import sys, torch
from specdec.models import kernels
kernels.build_for(sys.argv[3])
assert kernels.load(), kernels.unavailable_reason()
sys.path.insert(0, sys.argv[1])
from test_kernels import _attention_cases, _matmul_cases
isa = (kernels.isa(), torch.ops.specdec_attention.attend_isa())
torch.save({"isa": isa, "attention": _attention_cases(), "matmul": _matmul_cases()}, sys.argv[2])
"""


@pytest.fixture(scope="module")
def other_build(tmp_path_factory):
    """The kernels' outputs from a build for gcc's -march=`march` (built once per module and march)."""
    import subprocess
    import sys
    from pathlib import Path

    done: dict[str, dict] = {}

    def outputs(march: str) -> dict:
        if march not in done:
            out = tmp_path_factory.mktemp(march) / "out.pt"
            r = subprocess.run([sys.executable, "-c", OTHER_BUILD, str(Path(__file__).parent), str(out), march],
                               capture_output=True, text=True)
            if "bad value" in r.stderr:
                pytest.skip(f"this compiler does not know -march={march}")
            assert r.returncode == 0, r.stderr[-3000:]
            done[march] = torch.load(out)
        return done[march]

    return outputs


def _matmul_cases() -> list[torch.Tensor]:
    """Rows 1..9 of both widths, over group counts and row scales from 1e-3 to 1e2."""
    outs = []
    for bits in (4, 8):
        for n, k in [(48, 64), (960, 576), (144, 1536)]:
            _, (packed, scales, mins) = make(bits, n, k)
            x = torch.randn(9, k, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 2, 9)[:, None]
            outs += [kernels.matmul(x[:mm], packed, scales, mins, bits, n) for mm in range(1, 10)]
    return outs


def _attention_cases() -> list[torch.Tensor]:
    """Outputs of runs across chunk edges, windows, head sizes and a token tree (vectors, not tiles)."""
    before = torch.ops.specdec_attention.attend_allow_tiles(False)
    outs = []
    for n, window, hd, start, length in [(9, 0, 64, 100, 130), (21, 0, 64, 250, 420), (21, 200, 64, 250, 420),
                                         (7, 16, 96, 100, 130), (7, 0, 128, 100, 130), (7, 16, 256, 100, 130)]:
        q, k, v, kc, vc, meta, w, scale, cap = _attention_case(n, window, hd=hd, start=start, length=length)
        outs.append(torch.ops.specdec_attention.attend_tokens(q, k, v, kc, vc, meta, w, scale, cap))
    q, k, v, kc, vc, _, w, scale, cap = _attention_case(len(TREE), 0, length=160)
    outs.append(torch.ops.specdec_attention.attend_tokens(q, k, v, kc, vc, tree_meta(100), w, scale, cap))
    torch.ops.specdec_attention.attend_allow_tiles(before)
    return outs


def test_attention_runs_built_for_avx2_give_the_avx512_bits(other_build):
    """On AVX2-only CPUs the runs take two 8-lane halves for each 16-lane vector, every op and sum
    in AVX-512's order: a build for them gives this machine's bits (both batch-invariant alike)."""
    if torch.ops.specdec_attention.attend_isa() == "scalar":
        pytest.skip("no vector runs on this machine")
    avx2 = other_build("haswell")
    assert avx2["isa"][1] == "avx2", avx2["isa"]
    for ours, theirs in zip(_attention_cases(), avx2["attention"], strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("march", ["haswell", "x86-64"])  # AVX2; no vectors at all
def test_matmul_paths_give_the_same_bits(other_build, march):
    """The AVX2 and scalar paths sum the same exact integers in their own orders and fold them into
    floats op for op as VNNI does, so every build gives this machine's bits for every row count."""
    theirs = other_build(march)
    assert theirs["isa"][0] == ("avx2" if march == "haswell" else "scalar"), theirs["isa"]
    for i, (ours, other) in enumerate(zip(_matmul_cases(), theirs["matmul"], strict=True)):
        assert torch.equal(ours, other), f"case {i}"
