"""Statistical test: emitted tokens follow the verifier's distribution, and a wrong sampler fails."""
import pytest
import torch
from scipy.stats import chisquare

from specdec.rejection_sampler import rejection_sample

V, K, N = 5, 2, 30000
P_ROWS = torch.tensor([[0.50, 0.20, 0.15, 0.10, 0.05],
                       [0.05, 0.15, 0.30, 0.25, 0.25],
                       [0.10, 0.10, 0.10, 0.60, 0.10]])  # [K+1, V] verifier
Q_ROWS = torch.tensor([[0.10, 0.40, 0.10, 0.30, 0.10],
                       [0.30, 0.30, 0.10, 0.10, 0.20]])  # [K, V] draft


def correct_sampler(drafts, q, gen):
    out = rejection_sample(drafts, [K], [q], P_ROWS, [False], [gen])[0]
    return out[out >= 0]


def accept_always_sampler(drafts, q, gen):
    """Deliberately wrong: keeps every draft, so emitted tokens follow q, not p."""
    bonus = torch.multinomial(P_ROWS[K], 1, generator=gen)
    return torch.cat([drafts, bonus])


def no_residual_sampler(drafts, q, gen):
    """Deliberately wrong: resamples from p instead of max(0, p - q) after a rejection."""
    u = torch.rand(K, generator=gen)
    for i in range(K):
        if u[i] * q[i, drafts[i]] >= P_ROWS[i, drafts[i]]:
            return torch.cat([drafts[:i], torch.multinomial(P_ROWS[i], 1, generator=gen)])
    return torch.cat([drafts, torch.multinomial(P_ROWS[K], 1, generator=gen)])


def position_pvalues(sampler, n=N, seed=0):
    """Chi-square p-values of the emitted token at each position against the verifier's p.
    With p independent of the prefix, the token at position j (when emitted) ~ P_ROWS[j]."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(K + 1, V)
    for _ in range(n):
        drafts = torch.multinomial(Q_ROWS, 1, generator=gen).squeeze(1)  # [K] drafts ~ q
        for j, t in enumerate(sampler(drafts, Q_ROWS, gen).tolist()):
            counts[j, t] += 1
    pvals = []
    for j in range(K + 1):
        total = counts[j].sum()
        pvals.append(chisquare(counts[j].numpy(), (P_ROWS[j] * total).numpy()).pvalue)
    return pvals, counts


def test_rejection_sampler_matches_verifier_distribution():
    pvals, counts = position_pvalues(correct_sampler)
    assert counts[K].sum() > 1000  # the bonus position is exercised often enough to test
    assert min(pvals) > 1e-4, pvals


@pytest.mark.parametrize("bad", [accept_always_sampler, no_residual_sampler])
def test_same_check_catches_wrong_samplers(bad):
    pvals, _ = position_pvalues(bad)
    assert min(pvals) < 1e-6, pvals


def test_top_p_top_k_and_temperature_shape_p_and_q_alike():
    from specdec.sampling import SamplingParams, logits_to_probs

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5, top_k=3))
    assert probs[0, 3:].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    full = torch.softmax(logits, -1)
    assert full[0, 0] < 0.7 < full[0, :2].sum()  # so top-p keeps exactly two tokens
    assert (probs[0, 2:] == 0).all() and torch.allclose(probs[0, :2], full[0, :2] / full[0, :2].sum())
