"""Adaptive K: follows acceptance and measured costs, turns speculation off when it cannot pay,
probes to come back, and never changes greedy output."""
from conftest import make_engine, ragged_prompts
from specdec.adaptive import AdaptiveK, LinearFit, expected_tokens
from specdec.models.tiny import noisy_copy
from specdec.sampling import SamplingParams


def costs(verify_1=0.06, per_token=0.005, draft=0.004) -> AdaptiveK:
    ak = AdaptiveK(k_max=8)
    for _ in range(50):
        for n in (1, 3, 5, 9):
            ak.observe_verify(n, verify_1 + per_token * (n - 1))
        ak.observe_draft(1, 4, 4 * draft)
    return ak


def test_linear_fit_learns_the_cost_curve():
    fit = LinearFit(1.0, 1.0)
    for _ in range(200):
        for x in (1, 2, 5, 9):
            fit.observe(x, 0.05 + 0.01 * x)
    assert abs(fit(5) - 0.10) < 1e-3 and abs(fit(1) - 0.06) < 1e-3


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9


def test_high_acceptance_cheap_draft_speculates_deep():
    assert costs().choose([0.9], [8]) == [8]


def test_low_acceptance_turns_speculation_off_then_probes():
    ak = costs(draft=0.03)
    picks = [ak.choose([0.05], [8])[0] for _ in range(ak.probe_every)]
    assert picks[:-1] == [0] * (ak.probe_every - 1) and picks[-1] == 1


def test_budget_caps_k():
    a, b = costs().choose([0.9, 0.9], [2, 8])
    assert a == 2 and b > 2
    assert costs().choose([0.9], [0]) == [0]


def test_expensive_verify_growth_lowers_k():
    cheap, steep = costs(per_token=0.001).choose([0.6], [8])[0], costs(per_token=0.05).choose([0.6], [8])[0]
    assert steep < cheap


def test_adaptive_engine_is_lossless(tiny_target):
    plain = make_engine(tiny_target, k=0).generate(ragged_prompts()[:4], SamplingParams(max_tokens=30, ignore_eos=True))
    eng = make_engine(tiny_target, noisy_copy(tiny_target, 0.05), k=8)
    eng.adaptive = AdaptiveK(k_max=8)
    got = eng.generate(ragged_prompts()[:4], SamplingParams(max_tokens=30, ignore_eos=True))
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
