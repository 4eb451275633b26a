"""Hostile sampling settings stay finite: tiny temperatures decode greedily, and no row of logits
makes the sampler raise (a raise fails the pass of every sequence in the batch)."""
import pytest
import torch

from specdec.rejection_sampler import rejection_sample
from specdec.sampling import SAMPLING_EPS, SamplingParams, logits_to_probs

TINY_TEMPERATURES = [1e-38, 1e-45, 5e-324, SAMPLING_EPS / 2]


@pytest.mark.parametrize("t", TINY_TEMPERATURES)
def test_tiny_temperatures_are_greedy(t):
    assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy


@pytest.mark.parametrize("t", [SAMPLING_EPS, 1e-4, 0.7, 2.0, 100.0])
def test_probs_are_finite_distributions_at_any_temperature(t):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 1e4  # far past what a model emits
    for p in (SamplingParams(temperature=t), SamplingParams(temperature=t, top_k=3, top_p=0.5)):
        probs = logits_to_probs(logits, p)
        assert torch.isfinite(probs).all() and (probs >= 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    # at a tiny temperature the mass sits on the argmax
    assert (logits_to_probs(logits, SamplingParams(temperature=SAMPLING_EPS)).argmax(-1) == logits.argmax(-1)).all()


def test_probs_unchanged_at_ordinary_temperatures():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    want = torch.softmax(logits / 0.8, dim=-1)
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=0.8)), want)


def test_broken_logits_do_not_raise():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan] * 5, [1.0, inf, 2.0, -inf, 0.0], [-inf] * 5])
    probs = logits_to_probs(logits, SamplingParams(temperature=1e-3))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert int(probs[1].argmax()) == 1


def test_sampler_survives_rows_without_mass():
    """A target row of zeros or NaNs (no valid distribution) yields a token, not an exception."""
    target = torch.tensor([[0.0, 0.0, 0.0], [float("nan")] * 3, [0.2, 0.5, 0.3]])
    out = rejection_sample(torch.tensor([1], dtype=torch.long), [1, 0], [None, None],
                           target, [False, False], [torch.Generator().manual_seed(0)] * 2)
    assert out.shape == (2, 2) and all(0 <= t < 3 for t in out[:, 0].tolist())


def test_tiny_temperature_in_a_batch_with_a_sampled_request(tiny_target, tiny_tok):
    """The engine path (verifier and draft model): a 1e-38 request decodes greedily beside a
    sampled one, and both finish."""
    from conftest import make_engine

    eng = make_engine(tiny_target, draft=tiny_target, k=3, tok=tiny_tok)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    got = eng.generate(prompts, [SamplingParams(max_tokens=12, temperature=1e-38, ignore_eos=True),
                                 SamplingParams(max_tokens=12, temperature=0.9, seed=1, ignore_eos=True)])
    want = make_engine(tiny_target, draft=tiny_target, k=3, tok=tiny_tok).generate(
        prompts[:1], SamplingParams(max_tokens=12, ignore_eos=True))
    assert got[0].token_ids == want[0].token_ids and len(got[1].token_ids) == 12


def test_top_p_from_the_likeliest_tokens_equals_the_full_sort():
    """The nucleus found among the top NUCLEUS_FIRST_TRY tokens, or (flat rows) by the full sort,
    is the one the full sort finds."""
    from specdec.sampling import top_p_filter, top_p_filter_sorted

    g = torch.Generator().manual_seed(0)
    for scale in (8.0, 3.0, 0.1):  # peaked (nucleus in the top 256) ... flat (the fallback)
        probs = torch.softmax(torch.randn(4, 5000, generator=g) * scale, dim=-1)
        for top_p in (0.5, 0.9, 0.99):
            assert torch.allclose(top_p_filter(probs, top_p), top_p_filter_sorted(probs, top_p), atol=0, rtol=1e-6)


def test_draw_follows_the_distribution_and_never_picks_a_zero():
    from specdec.sampling import draw

    dist = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.0])
    g = torch.Generator().manual_seed(1)
    picks = torch.cat([draw(dist, g) for _ in range(4000)])
    counts = torch.bincount(picks, minlength=5)
    assert counts[0] == counts[2] == counts[4] == 0
    assert abs(counts[1].item() / 4000 - 0.75) < 0.03
