"""The sampling kernel (specdec/models/kernels/sampling.cpp) computes what torch's ops in
specdec.sampling do: the same probabilities under temperature, top-k and top-p (to float64's
values, which torch's float32 softmax misses on long-tailed rows), broken rows included, and draws
by inverse CDF that skip the rejected draft and never pick a zero."""
import pytest
import torch

from specdec.models import kernels
from specdec.sampling import SamplingParams, _probs, argmax_rows, logits_to_probs

pytestmark = pytest.mark.skipif(not kernels.sampling_fused(torch.zeros(1)),
                                reason="no sampling kernel here (it needs the kernels built with AVX-512)")

PARAMS = [SamplingParams(temperature=t, top_p=p, top_k=k)
          for t in (1e-3, 0.7, 1.0, 3.0) for p in (1.0, 0.95, 0.5) for k in (0, 1, 40)]


def torch_ops(logits: torch.Tensor, rows: list[SamplingParams]) -> torch.Tensor:
    inv_t = torch.tensor([1.0 / r.temperature for r in rows])[:, None]
    return _probs(logits, inv_t, [r.top_k if r.top_k < logits.shape[-1] else 0 for r in rows], [r.top_p for r in rows])


def exact_probs(logits: torch.Tensor, rows: list[SamplingParams]) -> torch.Tensor:
    """logits_to_probs's transform in float64, row by row: what its float32 results approximate."""
    out = []
    for x, r in zip(logits.double(), rows):
        x = (x - x.max()) / r.temperature
        if 0 < r.top_k < len(x):
            x = x.masked_fill(x < x.topk(r.top_k).values[-1], float("-inf"))
        p = torch.softmax(x, dim=-1)
        if r.top_p < 1.0:  # a token stays while the mass before it is under top_p (the first always)
            v, i = p.sort(descending=True, stable=True)
            keep = v.cumsum(0) - v < r.top_p
            keep[0] = True
            p = torch.zeros_like(p).index_put_((i[keep],), v[keep])
            p = p / p.sum()
        out.append(p.float())
    return torch.stack(out)


@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_probabilities_match_torchs_ops(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(len(PARAMS), vocab, generator=g) * 4  # continuous: no ties, whose order is arbitrary
    logits[:, :3] += 10  # a peaked head, as a model's rows have
    got = logits_to_probs(logits, PARAMS)
    torch.testing.assert_close(got, torch_ops(logits, PARAMS), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, exact_probs(logits, PARAMS), atol=2e-6, rtol=1e-5)
    assert torch.equal(got > 0, torch_ops(logits, PARAMS) > 0)  # the same tokens kept


def test_broken_rows_match_torchs_ops():
    nan, inf = float("nan"), float("inf")
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    logits[0] = nan  # no finite logit: uniform
    logits[1, :150] = nan  # NaN tokens never drawn
    logits[2, 7] = inf  # +inf as the largest float: all the mass
    logits[3, ::2] = -inf  # -inf tokens never drawn
    # top_p away from every row's running sums: where a sum lies within float32's rounding of it,
    # the kernel (float64 sums) and torch's ops (float32) may keep different nuclei, both rightly
    # (a uniform row of 300 has exactly 0.9 before its 271st token)
    rows = [SamplingParams(temperature=0.8, top_p=0.93)] * 4
    finite = logits[[1, 3]].nan_to_num(nan=float("-inf"))  # the rows with a nucleus to cut
    for x in exact_probs(finite, [SamplingParams(temperature=0.8)] * 2):
        assert (x.double().sort(descending=True).values.cumsum(0) - 0.93).abs().min() > 1e-5
    got = logits_to_probs(logits, rows)
    torch.testing.assert_close(got, torch_ops(logits, rows), atol=2e-6, rtol=1e-5)
    assert (got[1, :150] == 0).all() and got[2, 7] == 1 and (got[3, ::2] == 0).all()


def test_nuclei_past_the_kernels_thresholds():
    """The kernel sorts only the tokens above the highest of three thresholds (2^-8, 2^-16 and
    2^-24 of the likeliest token's mass) that holds top_p's mass: rows whose nucleus needs the
    tokens under the first, or under all three, keep what the full sort keeps."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 49152, generator=g) * 0.01
    logits[0] += -12 * 0.6931  # the rest ~2^-12 each: past the first threshold
    logits[1] += -25 * 0.6931  # ~2^-25 each: under all three
    logits[:, 0] = 0.0
    rows = [SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, top_p=0.9999)]
    got, want = logits_to_probs(logits, rows), exact_probs(logits, rows)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # the nucleus's last few tokens are where the running sums' rounding falls (float32 e^x over
    # ~45k tokens): each holds 3e-8 of the mass
    assert ((got > 0) != (want > 0)).sum() <= 4 and ((got > 0).sum(-1) > 20000).all()


def test_a_long_tail_keeps_its_mass():
    """The row's mass adds in double: in float, the lane holding the likeliest token drops every
    tail token under half its ulp, 1/16 (AVX-512) or 1/8 (AVX2) of a tail of 49151 at 2^-25."""
    logits = torch.full((1, 49152), -25 * 0.6931)
    logits[0, 0] = 0.0
    got = logits_to_probs(logits, [SamplingParams(temperature=1.0)])
    torch.testing.assert_close(got, exact_probs(logits, [SamplingParams(temperature=1.0)]), atol=1e-7, rtol=1e-5)
    assert abs(got.double().sum().item() - 1.0) < 1e-6


def test_draw_skips_its_token_and_follows_the_rest():
    p = torch.tensor([[0.0, 0.4, 0.1, 0.0, 0.3, 0.2]])
    n = 40000
    w = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = torch.ops.specdec_sampling.draw(p, torch.zeros(n, dtype=torch.long), torch.full((n,), 1), w)
    freq = torch.bincount(got, minlength=6) / n
    assert freq[0] == freq[1] == freq[3] == 0  # zeros and the skipped token
    torch.testing.assert_close(freq[[2, 4, 5]], torch.tensor([1 / 6, 1 / 2, 1 / 3]), atol=0.01, rtol=0)


def test_draw_says_where_no_mass_is_left():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [float("nan"), 0.5, 0.5]])
    w = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)
    got = torch.ops.specdec_sampling.draw(p, torch.tensor([0, 1, 2]), torch.tensor([1, -1, -1]), w)
    assert got.tolist() == [-1, -1, -1]
    assert torch.ops.specdec_sampling.draw(p, torch.tensor([0]), torch.tensor([-1]), w[:1]).tolist() == [1]


def test_argmax_is_torchs():
    """A greedy row's token is torch.argmax's: the first of tied maxima (bfloat16 logits tie
    often), a NaN ahead of any number, +inf and -inf where they lead, at widths that end mid-block."""
    g = torch.Generator().manual_seed(0)
    for V in (1, 7, 256, 300, 49152):
        x = torch.randn(24, V, generator=g).to(torch.bfloat16).float()  # ties among the rounded values
        x[1] = x[1].max()  # every token tied
        x[2] = float("-inf")
        x[3, V // 2] = float("inf")
        x[4, -1] = float("nan")
        x[5, V // 3] = float("nan")
        x[5, -1] = float("inf")
        x[6, V // 4 :] = x[6].max() + 1  # a tie from the middle to the end
        x[7] = float("nan")
        assert argmax_rows(x) == x.argmax(dim=-1).tolist(), V
        assert argmax_rows(x[::2]) == x[::2].argmax(dim=-1).tolist()  # rows apart
