"""Weight-layout tuning: the choice changes speed only, never results (beyond float rounding)."""
import torch

from specdec.models.layouts import decide, tune_layouts
from specdec.models.llama import Linear


def test_both_layouts_compute_the_same_and_dispatch_by_rows():
    torch.manual_seed(0)
    lin = Linear(64, 96, bias=True)
    torch.nn.init.normal_(lin.weight_t)
    torch.nn.init.normal_(lin.bias)
    x1, x3 = torch.randn(1, 64), torch.randn(3, 64)
    ref1, ref3 = x1 @ lin.weight_t + lin.bias, x3 @ lin.weight_t + lin.bias
    lin.set_layouts((False, False, True, True))  # the [out, in] copy from 2 rows on
    assert lin._w is not None and lin._w.is_contiguous()
    assert torch.equal(lin(x1), ref1)  # 1 row: still x @ W_t, bit for bit
    assert torch.allclose(lin(x3), ref3, atol=1e-4)
    lin.set_layouts((False, False))
    assert lin._w is None


def test_decide_covers_every_row_count(tiny_target):
    use_w = decide(torch.randn(32, 48), max_rows=9, cold_bytes=1e5)
    assert len(use_w) == 10 and use_w[0] is False
    decided = tune_layouts(tiny_target, cold_bytes=1e5)
    assert decided and all(len(v) == 17 for v in decided.values())
    for m in tiny_target.modules():  # leave the shared fixture as it was
        if isinstance(m, Linear):
            m.set_layouts(())
