"""Kernel tuning: the choice changes speed only, never results (beyond float rounding)."""
import pytest
import torch

from specdec.models import layouts
from specdec.models.layouts import decide, describe, dnn_available, packing_available, tune_layouts
from specdec.models.llama import Linear


def _linear():
    torch.manual_seed(0)
    lin = Linear(64, 96, bias=True)
    torch.nn.init.normal_(lin.weight_t)
    torch.nn.init.normal_(lin.bias)
    return lin


def test_kernels_compute_the_same_and_dispatch_by_rows():
    lin = _linear()
    x1, x3 = torch.randn(1, 64), torch.randn(3, 64)
    ref1, ref3 = x1 @ lin.weight_t + lin.bias, x3 @ lin.weight_t + lin.bias
    lin.set_kernels("ttww")  # the [out, in] copy from 2 rows on
    assert lin._w is not None and lin._w.is_contiguous()
    assert torch.equal(lin(x1), ref1)  # 1 row: still x @ W_t, bit for bit
    assert torch.allclose(lin(x3), ref3, atol=1e-4)
    lin.set_kernels("tt")
    assert lin._w is None


@pytest.mark.skipif(not packing_available(), reason="needs torch built with MKL")
def test_packed_kernel_serves_its_exact_row_count():
    lin = _linear()
    lin.set_kernels("tpwpt")  # packed at 1 and 3 rows, F.linear at 2, x @ W_t from 4 on
    assert sorted(lin._packed) == [1, 3]
    for rows in (1, 2, 3, 4, 7):
        x = torch.randn(1, rows, 64)
        assert torch.allclose(lin(x), x @ lin.weight_t + lin.bias, atol=1e-4)
    with pytest.raises(AssertionError):
        lin.set_kernels("ttp")  # the last entry serves every larger row count too


def test_decide_covers_every_row_count(tiny_target):
    kernels, unpacked = decide(torch.randn(32, 48), max_rows=9, cold_bytes=1e5)
    assert len(kernels) == len(unpacked) == 10 and kernels[0] == "t"
    assert set(unpacked) <= {"t", "w"} and kernels[-1] != "p"
    decided = tune_layouts(tiny_target, cold_bytes=1e5, pack_budget_bytes=0)  # no room: nothing packed
    assert decided and all(len(v) == 17 and "p" not in v for v in decided.values())
    assert all(len(v) == 16 for v in describe(decided).values())
    for m in tiny_target.modules():  # leave the shared fixture as it was
        if isinstance(m, Linear):
            m.set_kernels("")


@pytest.mark.skipif(not dnn_available(), reason="needs torch built with oneDNN")
def test_onednn_kernel_serves_every_row_count():
    lin = _linear()
    lin.set_kernels("tdd")  # oneDNN from 1 row on, its one packed copy for any count
    assert lin._dnn is not None and lin._w is None and not lin._packed
    for rows in (1, 2, 3, 7, 40):
        x = torch.randn(2, rows, 64)
        assert torch.allclose(lin(x), x @ lin.weight_t + lin.bias, atol=1e-4)


def test_budget_pays_one_onednn_copy_per_weight_and_falls_back_beyond_it(monkeypatch):
    """An MKL packing costs a copy per row count, a oneDNN one a copy per weight; a choice
    that does not fit falls back to the best kernel without a copy."""
    weight_bytes = 48 * 32 * 4
    model = torch.nn.Sequential(Linear(48, 32), Linear(48, 32))  # one shape, two weights
    monkeypatch.setattr(layouts, "decide", lambda *a, **k: ("tdddd", "ttwww"))
    kept = tune_layouts(model, max_rows=4, pack_budget_bytes=2 * weight_bytes)  # room for the one copy
    assert list(kept.values()) == ["tdddd"]
    short = tune_layouts(model, max_rows=4, pack_budget_bytes=weight_bytes)  # half of it: none
    assert list(short.values()) == ["ttwww"]
    monkeypatch.setattr(layouts, "decide", lambda *a, **k: ("tpddd", "ttwww"))
    mixed = tune_layouts(model, max_rows=4, pack_budget_bytes=4 * weight_bytes)  # 1 row's packing + oneDNN
    assert list(mixed.values()) == ["tpddd"]
    tight = tune_layouts(model, max_rows=4, pack_budget_bytes=3 * weight_bytes)  # the fewest rows first
    assert list(tight.values()) == ["tpwww"]
    for m in model:
        m.set_kernels("")


def test_decisions_are_cached_per_machine_and_shape(monkeypatch, tmp_path):
    """A replica's later starts reuse what an earlier one timed; another shape, another thread
    count (or a corrupt file) times again, and a file that cannot be written is no error."""
    calls = []
    monkeypatch.setattr(layouts, "decide", lambda w, *a: calls.append(tuple(w.shape)) or ("tww", "tww"))
    model = torch.nn.Sequential(Linear(48, 32), Linear(48, 32), Linear(32, 16))  # two shapes
    cache = tmp_path / "layouts.json"
    first = tune_layouts(model, max_rows=2, pack_budget_bytes=0, cache=cache)
    assert sorted(calls) == [(32, 16), (48, 32)] and cache.exists()
    assert tune_layouts(model, max_rows=2, pack_budget_bytes=0, cache=cache) == first and len(calls) == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        tune_layouts(model, max_rows=2, pack_budget_bytes=0, cache=cache)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 4
    cache.write_text("{not json")  # a half-written file is not an error: it is timed again
    tune_layouts(model, max_rows=2, pack_budget_bytes=0, cache=cache)
    assert len(calls) == 6 and len(layouts._read_cache(cache)) == 2
    blocked = tmp_path / "file" / "layouts.json"  # its directory cannot be made: not an error
    (tmp_path / "file").write_text("")
    tune_layouts(model, max_rows=2, pack_budget_bytes=0, cache=blocked)
    for m in model:
        m.set_kernels("")
