"""Adaptive K: follows acceptance and measured costs, turns speculation off when it cannot pay,
probes to come back, and never changes greedy output."""
import pytest

from conftest import make_engine, ragged_prompts
from specdec.adaptive import AdaptiveK, CostCurve, DraftCost, LinearFit
from specdec.models.tiny import noisy_copy
from specdec.sampling import SamplingParams


def costs(verify_1=0.06, per_token=0.005, draft=0.004) -> AdaptiveK:
    """Costs measured at 1 and 2 users (memory-bound: a second sequence costs like a token)."""
    ak = AdaptiveK(k_max=8)
    for _ in range(50):
        for b in (1, 2):
            for n in (1, 3, 5, 9, 17):
                ak.observe_verify(b, b * n, verify_1 + per_token * (b * n - 1))
        ak.observe_draft(1, 4, 4 * draft)
    return ak


def test_linear_fit_learns_the_cost_curve():
    fit = LinearFit(1.0, 1.0)
    for _ in range(200):
        for x in (1, 2, 5, 9):
            fit.observe(x, 0.05 + 0.01 * x)
    assert abs(fit(5) - 0.10) < 1e-3 and abs(fit(1) - 0.06) < 1e-3


def test_cost_curve_interpolates_and_scales_the_prior_outside_what_it_saw():
    curve = CostCurve(0.06, 0.01)
    assert abs(curve(5) - 0.11) < 1e-9  # nothing seen yet: the prior
    curve.observe(16, 0.15)
    curve.observe(32, 0.25)
    assert abs(curve(24) - 0.20) < 1e-9
    assert abs(curve(8) - 0.15 * 0.14 / 0.22) < 1e-9  # below: the prior's shape through (16, 0.15)
    assert curve(64) > curve(32)
    curve.observe(16, 0.25)
    assert 0.15 < curve(16) < 0.25  # an EMA, not the last value


def test_a_flat_then_steep_curve_speculates_alone_but_not_in_a_big_batch():
    # 1 user: 5 tokens cost 1.2x one; 16 users: compute-bound, 32 tokens cost 1.9x 16
    ak = AdaptiveK(k_max=4)
    for _ in range(20):
        for b, x, y in ((1, 1, 0.050), (1, 2, 0.052), (1, 3, 0.055), (1, 5, 0.060), (16, 16, 0.20), (16, 32, 0.38)):
            ak.observe_verify(b, x, y)
        ak.observe_draft(1, 2, 0.004)
        ak.observe_draft(16, 1, 0.010)
    assert ak.choose([0.4], [4])[0] > 0
    assert ak.choose([0.4] * 16, [4] * 16) == [0] * 16


def test_no_probes_where_even_a_good_draft_could_not_pay():
    """At 16 users the pass is compute-bound: a new request's probe (or the periodic one) would
    hold up the batch for a draft call and widen its pass, so it waits; alone, it is probed."""
    ak = AdaptiveK(k_max=4)
    for _ in range(20):
        for b, x, y in ((1, 1, 0.050), (1, 3, 0.055), (16, 16, 0.20), (16, 32, 0.38)):
            ak.observe_verify(b, x, y)
        ak.observe_draft(1, 2, 0.02)
    assert ak.choose([0.05] * 16, [4] * 16, new=[True] + [False] * 15) == [0] * 16
    assert all(ak.choose([0.05] * 16, [4] * 16) == [0] * 16 for _ in range(3 * ak.probe_every))
    assert ak.choose([0.05], [4], new=[True]) == [2]


def test_an_unseen_batch_size_borrows_the_nearest_curve():
    """Smaller than one measured: the nearest curve, scaled. Bigger than all: its plain pass is
    scaled the same way, but draft tokens cost in proportion (it may be compute-bound), until a
    probe measures it; that probe is made even where the pessimistic cost says it cannot pay."""
    ak = AdaptiveK()
    for x, y in ((4, 0.08), (8, 0.10)):
        ak.observe_verify(4, x, y)
    assert abs(ak.verify_cost(2, 4) - 0.10 / 2) < 1e-9
    assert abs(ak.verify_cost(8, 8) - 2 * 0.08) < 1e-9
    assert abs(ak.verify_cost(8, 16) - 2 * 0.08 * 2) < 1e-9  # not the flat curve's 2 * 0.10
    assert ak.verify_cost(4, 8) == 0.10
    for _ in range(20):
        ak.observe_draft(4, 2, 0.004)
    assert ak.choose([0.6] * 8, [4] * 8) == [0] * 8  # 1.6 tokens for 2 tokens' cost: no
    assert ak.choose([0.6] * 8, [4] * 8, new=[True] + [False] * 7) == [2] + [0] * 7  # but one probe measures it


def test_acceptance_estimate_does_not_drift_back_to_the_prior_at_k0():
    ak = costs()
    for _ in range(50):
        ak.observe_round([(4, 0)])
    low = ak.global_acceptance()
    for _ in range(1000):
        ak.observe_round([(0, 0)])
    assert low < 0.1 and ak.global_acceptance() == low


def test_acceptance_is_learned_per_draft_position():
    ak = AdaptiveK(k_max=4)
    for _ in range(100):  # the first draft is accepted 60% of the time, later ones never
        ak.observe_round([(4, 1)] * 6 + [(4, 0)] * 4)
    a1, a2 = ak.position_acceptance()[:2]
    assert abs(a1 - 0.6) < 0.05 and a2 < 0.1
    for b, x, y in ((1, 1, 0.050), (1, 2, 0.052), (1, 3, 0.054), (1, 5, 0.058)):
        for _ in range(5):
            ak.observe_verify(b, x, y)
    assert ak.choose([ak.global_acceptance()], [4]) == [1]  # deeper drafts would be wasted


def test_predictions_that_run_high_are_calibrated_down_at_that_batch_size():
    """Two sequences whose records (0.6) are read against an overall rate that runs far lower,
    as a record made at a small K is read against one that deep drafting elsewhere pulls down:
    K=1 for both is predicted ~1 accepted draft a round and one in eight comes. Calibrated, the
    batch size stops drafting after a few rounds (probes apart); the negative control, with the
    calibration held at 1 (an infinite pseudo-count), drafts every round. One sequence is never
    calibrated, and predictions that ran low never raise the estimate."""
    def drafting_rounds(weight: float) -> tuple[int, AdaptiveK]:
        ak, n = costs(), 0
        ak.calibration_weight = weight
        for i in range(100):
            ks = ak.choose([0.6] * 2, [4] * 2)
            n += any(ks)
            ak.observe_round([(k, int(k > 0 and j == 0 and i % 4 == 0)) for j, k in enumerate(ks)],
                             predicted=ak.last_prediction)
        return n, ak

    n, ak = drafting_rounds(30.0)
    assert n <= 15 and ak.calibration(2) < 0.9, (n, ak.calibration(2))
    assert drafting_rounds(1e12)[0] >= 95  # the control keeps drafting
    assert ak.calibration(1) == 1.0
    low = costs()
    for _ in range(20):
        low.observe_round([(4, 4)] * 2, predicted={"model_accepted_raw": 1.0})
    assert low.calibration(2) == 1.0


def test_failed_probes_back_off():
    ak = costs(draft=0.03)
    gaps, since = [], 0
    for _ in range(300):
        since += 1
        if ak.choose([0.05], [8])[0]:
            gaps.append(since)
            since = 0
    assert gaps[:4] == [16, 32, 64, 128]


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


def test_every_new_request_is_probed_once_even_when_speculation_is_off():
    ak = costs()
    assert ak.choose([0.05], [8], new=[False]) == [0]
    # two new requests: probed together (one pass and one draft call for both, cheaper than two
    # rounds), each up to its budget
    assert ak.choose([0.05, 0.05], [8, 1], new=[True, True]) == [2, 1]
    assert ak.choose([0.05, 0.05], [8, 8], new=[False, True]) == [0, 2]  # only the new one drafts


def test_lookup_matches_get_their_own_k_from_their_own_acceptance():
    """Prompt-lookup drafts are free and accepted very differently from the model's: a sequence
    with a match drafts by lookup even while the model's drafts do not pay, and vice versa."""
    ak = costs(draft=0.03)
    for _ in range(50):
        ak.observe_round([(4, 0), (4, 4)], looked_up=[False, True])
    assert ak.global_acceptance() < 0.1 and ak.lookup.overall() > 0.9
    a, la = ak.acceptance(0, 40), ak.lookup.of_sequence(40, 40)
    assert ak.choose([a, a], [8, 8], lookups=[0, 6], lookup_acceptances=[la, la]) == [0, 6]
    # a match whose copies keep being rejected is not verified
    bad = AdaptiveK(k_max=8)
    for _ in range(50):
        bad.observe_round([(4, 0)], looked_up=[True])
        bad.observe_verify(1, 1, 0.05), bad.observe_verify(1, 5, 0.08)
    assert bad.choose([0.5], [8], lookups=[4], lookup_acceptances=[bad.lookup.of_sequence(0, 200)]) == [0]


def test_a_one_pass_call_is_not_costed_as_a_share_of_a_multi_step_one():
    """Serve at 16 users, as measured: 4-step plain calls cost 0.11 s per pass, one-pass calls
    (probes) 0.21 s at 32 tokens and 0.28 s at 48 (each pays a whole call's overhead). Two
    sequences with long prompt-lookup matches must not turn a 4-step call into a one-pass one
    (that lost 10-20 % in Serve); costed as a share of a multi-step call, as before, they did.
    Alone, a well-accepting sequence still speculates, a mediocre one does not."""
    def model(multi_step: bool) -> AdaptiveK:
        ak = AdaptiveK(k_max=4)
        for _ in range(20):
            ak.observe_verify(16, 16, 0.11, steps=4 if multi_step else 1)
            ak.observe_verify(16, 32, 0.21)
            ak.observe_verify(16, 48, 0.28)
            ak.observe_verify(1, 1, 0.047, steps=4 if multi_step else 1)
            for x, y in ((2, 0.074), (3, 0.076), (5, 0.080)):
                ak.observe_verify(1, x, y)
            ak.observe_draft(1, 2, 0.01)
        return ak

    lookups, sure = [0] * 14 + [4, 4], [1.0] * 16
    assert model(True).choose([0.3] * 16, [4] * 16, lookups=lookups, lookup_acceptances=sure) == [0] * 16
    assert model(False).choose([0.3] * 16, [4] * 16, lookups=lookups, lookup_acceptances=sure) != [0] * 16
    assert model(True).choose([0.3], [4]) == [0]
    assert model(True).choose([0.95], [4])[0] > 0


def test_users_arriving_together_are_not_probed_on_their_joint_optimism():
    """Sixteen new requests in one round at a compute-bound batch: none is probed, though all of
    them accepting at probe_optimism together would look worth a round (Serve at 16 users lost
    ~7 % to rounds that probed all of them at once, every pass widened for drafts accepted at
    ~0.35)."""
    ak = AdaptiveK(k_max=4)
    for _ in range(20):
        ak.observe_verify(16, 16, 0.11, steps=4)
        ak.observe_verify(16, 20, 0.13)
        ak.observe_draft(16, 2, 0.02)
    assert sum(k > 0 for k in ak.choose([0.3] * 16, [4] * 16, new=[True] * 16)) <= 1
    alone = costs(draft=0.03)
    # at a batch size bigger than any measured, one alone: its round measures what a pass there costs
    assert alone.choose([0.05, 0.05, 0.05], [8, 8, 8], new=[True] * 3) == [2, 0, 0]


def four_users(verify_12: float) -> AdaptiveK:
    """Serve at 4 users as measured in session 17: 4-step plain calls 53 ms a pass, a one-pass
    call 58 ms at 6 tokens, verify_12 at 12; a draft call ~15 ms."""
    ak = AdaptiveK(k_max=8)
    for _ in range(20):
        ak.observe_verify(4, 4, 0.053, steps=4)
        for t, y in ((5, 0.056), (6, 0.058), (8, 0.062), (12, verify_12)):
            ak.observe_verify(4, t, y)
        ak.observe_draft(1, 2, 0.012)
        ak.observe_draft(4, 2, 0.018)
    return ak


def test_new_requests_are_probed_together_where_that_costs_less():
    """Four requests arriving together at 4 users: one probe round for all four (one call, one
    draft call, one pass of 12 tokens) instead of four lone probes, each a one-pass call where a
    plain step is a quarter of a 4-step one (four lone probes cost ~3 % of a rep in Serve). Where
    the pass for all their drafts would cost far more than four small ones, one at a time."""
    assert four_users(0.075).choose([0.4] * 4, [8] * 4, new=[True] * 4) == [2, 2, 2, 2]
    assert four_users(0.4).choose([0.4] * 4, [8] * 4, new=[True] * 4) == [2, 0, 0, 0]


def test_a_batch_size_never_decoded_plainly_is_not_charged_a_whole_call_per_pass():
    """4 users who speculated from their first round never showed what a plain 4-step pass costs
    at batch 4; the one-pass curve charges each pass a whole call. Plain passes measured at 1-3
    users give it (linearly in the batch size), and K=1 at acceptance 0.47 no longer pays."""
    ak = AdaptiveK(k_max=4)
    for _ in range(20):
        for b, x, y in ((1, 1, 0.055), (1, 2, 0.058), (4, 6, 0.095), (4, 8, 0.079), (4, 12, 0.107)):
            ak.observe_verify(b, x, y)
        for b, y in ((1, 0.045), (2, 0.052), (3, 0.058)):
            ak.observe_verify(b, b, y, steps=4)
        ak.observe_draft(4, 1, 0.018)
        ak.observe_round([(1, 1), (1, 0)] * 10)  # ~0.5 of first drafts accepted
    assert abs(ak._plain_pass_cost(4) - 0.0645) < 0.002
    assert ak.choose([0.47] * 4, [4] * 4) == [0] * 4
    ak._multi_step_pass.clear()  # as before: the one-pass curve's 4-token cost, a whole call per pass
    assert ak.choose([0.47] * 4, [4] * 4) != [0] * 4


def _round_for(ak: AdaptiveK, room: int = 40, last_accepted: int = -1, prefilling_too: bool = False) -> list[int]:
    """K chosen by a Round for one sequence past its prefill (and, optionally, one in its prefill)."""
    from specdec.rounds import Round
    from specdec.sequence import Sequence

    def seq(i: int, out: int) -> Sequence:
        s = Sequence(f"s{i}", [5, 6, 7, 8], SamplingParams(max_tokens=out + room, ignore_eos=True), 8, 4096)
        s.output_ids = [9] * out
        s.tokens += s.output_ids
        return s

    batch = [seq(0, 3)] + ([seq(1, 0)] if prefilling_too else [])
    if last_accepted >= 0:
        batch[0].metrics.record_round(max(2, last_accepted), last_accepted)
    return Round(batch, {s.seq_id: "draft" for s in batch}, ak).ks


def low_acceptance() -> AdaptiveK:
    """Costs as costs(), and new requests' first drafts have mostly been rejected."""
    ak = costs()
    for _ in range(50):
        ak.observe_round([(2, 0)], first=[True])
    return ak


def test_slow_start_drafts_deeper_only_as_a_sequences_drafts_are_accepted():
    """Deep positions' acceptance is learned from the sequences that reach them (the best ones):
    with slow start a new request starts at first_probe_k drafts and doubles as it accepts them."""
    ak = costs()
    assert ak.choose([0.9], [8]) == [8]  # the cost model alone would go deep at once
    assert ak.model_cap(-1) == 8  # slow start is off by default
    ak.slow_start = True
    assert [ak.model_cap(n) for n in (-1, 0, 1, 2, 4)] == [2, 2, 2, 4, 8]
    assert _round_for(ak) == [2]
    assert _round_for(ak, last_accepted=2)[0] <= 4


def test_a_new_request_is_expected_to_accept_what_first_rounds_did():
    """The overall estimate weights requests by how much they drafted, so one well-accepted answer
    that drafted deep dominates it; a request with no record of its own leans on first rounds."""
    ak = AdaptiveK(k_max=8)
    for _ in range(30):  # thirty requests' first rounds: one draft in four accepted
        ak.observe_round([(2, 1), (2, 0)], first=[True, True])
    for _ in range(40):
        ak.observe_round([(8, 8)])  # then one request accepting everything, drafting deep
    assert ak.global_acceptance() > 0.8
    assert abs(ak.acceptance(0, 0) - ak.first.overall()) < 1e-9 and ak.acceptance(0, 0) < 0.35
    assert ak.acceptance(40, 40) > 0.9  # its own record still wins


def test_no_probe_is_forced_into_a_round_that_prefills_a_prompt():
    """A prefilling pass is not costed (the prompt dominates it) and with multi-step calls a draft
    there cuts every sequence's plain steps to one: probes wait for the next round."""
    ak = low_acceptance()
    assert ak.choose([0.05, 0.05], [8, 0], new=[True, False], prefilling=True) == [0, 0]
    assert ak.choose([0.05, 0.05], [8, 0], new=[True, False]) == [2, 0]
    picks = [ak.choose([0.05], [8], prefilling=True)[0] for _ in range(2 * ak.probe_every)]
    assert picks == [0] * len(picks) and ak.choose([0.05], [8]) == [1]  # the periodic probe, once it can
    assert _round_for(low_acceptance(), prefilling_too=True) == [0, 0]
    assert _round_for(low_acceptance()) == [2]


def test_with_multi_step_calls_nothing_drafts_in_a_round_that_prefills():
    """In-process (one step per pass) a well-accepting sequence may draft beside a new prompt's
    prefill; once plain calls run several steps, a draft there would cut them all to one."""
    ak = costs()
    assert ak.choose([0.9, 0.5], [8, 0], prefilling=True)[0] > 0
    ak.observe_verify(2, 2, 0.05, steps=4)
    assert ak.choose([0.9, 0.5], [8, 0], prefilling=True) == [0, 0]
    assert ak.choose([0.9, 0.5], [8, 0])[0] > 0


def test_a_request_near_its_end_is_not_probed():
    assert _round_for(low_acceptance(), room=40) == [2]
    assert _round_for(low_acceptance(), room=AdaptiveK.probe_min_room - 1) == [0]


def test_an_unmeasured_batch_size_is_scaled_as_its_plain_passes_compare():
    """Serve, session 12: one-pass cost measured at 16 users only; 14 users' one-pass cost guessed
    by the batch ratio (14/16) came out level with their measured plain pass, so a probe looked free."""
    ak = AdaptiveK(k_max=4)
    ak.observe_verify(16, 18, 0.158)
    ak.observe_verify(16, 16, 0.123, steps=4)
    ak.observe_verify(14, 14, 0.134, steps=4)
    assert abs(ak.verify_cost(14, 16) - 0.158 * 0.134 / 0.123) < 1e-9
    assert ak.verify_cost(14, 16) > ak._plain_pass_cost(14)


def test_no_speculation_at_a_batch_size_until_its_plain_pass_is_measured():
    """Serve, session 12, as measured: plain 4-step passes known at 1-4 users only, a 16-user
    one-pass call of 18-32 tokens at 0.15 s. Linear from 1-4 users, 16 users' plain pass came out at
    0.17 s (0.12 measured), and K=1 for all, or each new request's probe in turn, looked like a
    gain; now a plain round measures it first, and then K=1 at acceptance 0.3 does not pay."""
    ak = AdaptiveK(k_max=4)
    for _ in range(20):
        for b, y in ((1, 0.049), (3, 0.064), (4, 0.072)):
            ak.observe_verify(b, b, y, steps=4)
        for x in (18, 32):
            ak.observe_verify(16, x, 0.15)
        ak.observe_draft(16, 1, 0.025)
    assert ak._plain_pass_cost(16) > 0.16  # the estimate that misled
    assert ak.choose([0.3] * 16, [4] * 16) == [0] * 16
    assert ak.choose([0.3] * 16, [4] * 16, new=[True] * 16) == [0] * 16  # not even a new request's probe
    ak.observe_verify(16, 16, 0.12, steps=4)
    assert ak.choose([0.3] * 16, [4] * 16) == [0] * 16
    assert ak.choose([0.95] * 16, [4] * 16) != [0] * 16  # at high acceptance it would pay


def test_a_fresh_server_decodes_plainly_before_it_speculates():
    """Serve, session 21: on a fresh server the first request drafted K=2 in every round (23.5
    tok/s), pricing plain decoding as one-pass calls (17 tok/s) where a 4-step call's passes gave
    26.6: no plain call had been measured, so none ever was. Told that plain rounds run several
    steps per call (the round loop does it), a batch size decodes plainly until one is measured."""
    from deployments.driver import RoundLoop

    def fresh(multi_step: bool) -> AdaptiveK:
        ak = costs()  # one-pass calls: 0.06 s for 1 token, 0.005 s a token more
        ak.multi_step = multi_step
        return ak

    assert fresh(False).choose([0.6], [8]) != [0]  # the trap: drafting beats a whole call per token
    ak = fresh(True)
    assert ak.choose([0.6], [8]) == [0] and ak.choose([0.6], [8], new=[True]) == [0]  # no probe either
    ak.observe_verify(1, 1, 0.038, steps=4)
    assert ak.choose([0.6], [8]) == [0]  # against 0.038 s a token, 0.6 acceptance does not pay
    assert ak.choose([0.6], [8], new=[True]) == [2]  # a new request's probe may now find better
    assert RoundLoop(None, None, 16, adaptive=AdaptiveK(), decode_steps=4).adaptive.multi_step
    assert not RoundLoop(None, None, 16, adaptive=AdaptiveK(), decode_steps=1).adaptive.multi_step


def test_draft_cost_tells_a_per_step_cost_from_a_per_sequence_one():
    """A draft call costs a + b K + c K B. With calls at one batch size only, b and c cannot be
    told apart: a probe hopes for the per-step case (a GPU's launch-bound draft), choices keep the
    line in K x B (right on this CPU, and cautious). With calls at two, a probe is priced by the
    fit, launch-bound or compute-bound as measured."""
    gpu, cpu = DraftCost(0.002, 0.0015), DraftCost(0.002, 0.0015)
    for _ in range(30):
        for k in (1, 2, 4, 8):
            gpu.observe(1, k, 0.001 + 0.0016 * k)
            cpu.observe(1, k, 0.015 + 0.004 * k)
    assert abs(gpu(16, 2) - (0.001 + 0.0016 * 32)) < 2e-3  # the line in K x B
    assert abs(gpu.optimistic(16, 2) - gpu(1, 2)) < 1e-9  # a probe hopes for the per-step case
    for _ in range(30):
        for k in (1, 2):
            gpu.observe(4, k, 0.001 + 0.0016 * k + 0.00002 * 4 * k)
            cpu.observe(4, k, 0.015 + 0.004 * 4 * k)
    assert abs(gpu.optimistic(16, 2) - (0.001 + 0.0032 + 0.00064)) < 5e-4
    assert abs(cpu.optimistic(16, 2) - (0.015 + 0.004 * 32)) < 2e-3


def test_draft_cost_with_too_few_distinct_calls_keeps_to_what_they_determine():
    """Calls at two (K, B) points only (1-user K=2 probes and one 16-user K=1 probe, as in Serve):
    three terms are not determined, so the fit keeps to two that are (on these CPU-like costs:
    fixed and per sequence-step), not a near-singular solution."""
    cost = DraftCost(0.002, 0.0015)
    for _ in range(20):
        cost.observe(1, 2, 0.015 + 0.004 * 2)
    cost.observe(16, 1, 0.015 + 0.004 * 16)
    assert cost.coef is not None and all(abs(v) < 1 for v in cost.coef)
    assert abs(cost.optimistic(16, 1) - 0.079) < 1e-3 and abs(cost.optimistic(1, 2) - 0.023) < 1e-3


def test_on_a_gpu_a_big_batch_probes_once_and_then_speculates():
    """The lent H200, session 13: the verify cost is flat to 16 tokens per sequence and a draft
    step costs the same for 1 sequence or 16, but with draft calls seen at 1 user only and no
    16-user pass longer than 18 tokens, speculating at 16 users was priced by the CPU-like prior
    and a line in K x B, and never tried. A probe is now priced optimistically (the measured
    curve's slope, the per-step draft cost): it is made, and what it measures makes K > 0 pay.
    On this CPU's costs the same probe is made once and speculation stays off."""
    def run(verify, draft):
        ak = AdaptiveK(k_max=4)
        for _ in range(20):
            for t in (1, 3, 5):
                ak.observe_verify(1, t, verify(t))
            ak.observe_verify(16, 16, verify(16) * 1.05)
            ak.observe_verify(16, 18, verify(18) * 1.05)
            for k in (2, 4):
                ak.observe_draft(1, k, draft(1, k))
            ak.observe_round([(4, 3)])  # acceptance ~0.7
        chosen = []
        for _ in range(3 * ak.probe_every):
            ks = ak.choose([0.7] * 16, [4] * 16)
            if any(ks):
                ak.observe_verify(16, 16 + sum(ks), verify(16 + sum(ks)) * 1.05)
                ak.observe_draft(16, max(ks), draft(16, max(ks)))
            chosen.append(max(ks))
        return chosen

    gpu = run(lambda t: 0.0075 + 0.00002 * t, lambda b, k: 0.001 + 0.0016 * k + 0.00002 * b * k)
    assert gpu[0] == 0 and gpu[-1] > 0  # probed, then speculating
    cpu = run(lambda t: 0.05 + 0.005 * t, lambda b, k: 0.015 + 0.004 * b * k)
    assert sum(k > 0 for k in cpu) <= 1 and cpu[-1] == 0


def test_a_probe_is_not_justified_by_hope_at_a_depth_it_would_not_measure():
    """Serve at 4 users, session 13's costs: 4-step plain passes 0.063 s, a one-pass call with a
    2-draft probe 0.099 s, draft calls at 1 user. Were the verify cost past 6 tokens read hopefully
    (flat) at every K, a deep K would seem to pay, the K=2 probe would never measure past 6
    tokens, and every new request would be probed (9 drafting rounds a level, 0.96x K=0 paired,
    against 1 before): hope is only for the pass the probe itself makes."""
    ak = AdaptiveK(k_max=8)
    ak.observe_verify(4, 4, 0.063, steps=4)
    ak.observe_verify(1, 1, 0.047, steps=4)
    for _ in range(10):
        ak.observe_verify(4, 6, 0.099)
        for t in (1, 3, 5, 9):
            ak.observe_verify(1, t, 0.06 + 0.004 * t)
        ak.observe_draft(1, 2, 0.02)
    assert ak.choose([0.3] * 4, [8] * 4, new=[True, False, False, False]) == [0] * 4


def test_the_decision_rules_find_a_gpus_gain_and_stay_off_on_this_cpu():
    """bench/adaptive_sim.py: the H200's shape of costs with a code-like draft gains at 1 and 4
    users (mean of 8 seeds) and never loses at 16, where a gain is found in some seeds only (it
    hangs on the probe back-off the 4-user level leaves behind); this CPU's shape never costs
    more than a few % against K=0."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "adaptive_sim.py"
    spec = importlib.util.spec_from_file_location("adaptive_sim", path)
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    gpu = [sim.simulate("h200", 0.66, seed=seed) for seed in range(8)]
    assert all(sum(g[u]["vs_k0"] for g in gpu) / len(gpu) > 1.05 for u in (1, 4)), gpu
    assert all(g[16]["vs_k0"] > 0.99 for g in gpu) and any(g[16]["vs_k0"] > 1.03 for g in gpu), gpu
    cpu = sim.simulate("cpu", 0.37)
    assert all(cpu[u]["vs_k0"] > 0.96 for u in (1, 4, 16)), cpu
    # Serve's shape here (4-step plain calls), answers that differ and open easier than they go
    # on: 16 users stay level with K=0, 4 users lose ~3 % (here mostly lockstep: answers of one
    # length keep plain decoding's batch full to the end, speculation spreads their ends)
    serve = sim.simulate("serve-cpu", 0.45, first_bonus=0.12, concentration=3.0)
    assert serve[1]["vs_k0"] > 0.96 and serve[4]["vs_k0"] > 0.95 and serve[16]["vs_k0"] > 0.99, serve


def test_a_stale_plain_cost_is_measured_again():
    """A plain pass measured while the machine was busy (0.12 s where it costs 0.09) makes K=1
    for all sixteen look like a gain, and speculating every round nothing measured it again
    (session 17, a CPU-bound job beside serve_load: 147 drafting rounds of 239, 0.93x K=0).
    After plain_refresh_every such rounds one round decodes plainly, its measurement replaces
    the stale one, and speculation stops."""
    ak = AdaptiveK(k_max=4)
    for _ in range(20):
        ak.observe_verify(16, 32, 0.13)
        ak.observe_draft(16, 1, 0.02)
    ak.observe_verify(16, 16, 0.12, steps=4)  # measured while busy
    acc = [0.6] * 16
    drafting = [ak.choose(acc, [4] * 16) for _ in range(ak.plain_refresh_every)]
    assert all(ks == [1] * 16 for ks in drafting)
    assert ak.choose(acc, [4] * 16) == [0] * 16  # the refresh
    ak.observe_verify(16, 16, 0.09, steps=4)
    assert ak.choose(acc, [4] * 16) == [0] * 16  # and K=1 no longer pays
    assert ak.state()["multi_step_pass_s"][16] == 0.09


def test_a_probe_rides_along_a_plain_call_and_is_costed_by_its_own_pass():
    """With multi-step calls a probe does not cut the batch's plain steps to one (in Serve at 16
    users that was one more call per rep and answers out of step, ending in one more again, ~2-5 %
    of the rep that probed): its drafts go in the call's first pass and every sequence then decodes
    its plain steps. Adaptive K learns from such a call its first pass plus the call's overhead,
    as the one-pass call it stands for, not a share of a plain multi-step call."""
    from specdec.protocol import Proposal, VerifyResult
    from specdec.rounds import Round
    from specdec.sequence import Sequence

    ak = costs()
    ak.observe_verify(3, 3, 0.05, steps=4)  # 4-step plain calls measured at 3 sequences
    seqs = [Sequence(f"s{i}", [1, 2, 3], SamplingParams(max_tokens=40), 8, 512) for i in range(3)]
    for s in seqs:
        s.commit(VerifyResult([5], 0, 0))  # past their prefill, no draft verified yet
    rnd = Round(seqs, {s.seq_id: "draft" for s in seqs}, ak)
    assert ak.last_probe and rnd.ride_along and rnd.ks == [2, 0, 0]  # 3 sequences never drafted for: one probe
    [(idx, reqs)] = rnd.propose_requests().values()
    rnd.set_proposals(idx, [Proposal([7] * q.num_speculative_tokens, None) for q in reqs], 0.0)
    vreqs = rnd.verify_requests(decode_steps=4)
    assert [q.num_steps for q in vreqs] == [4, 4, 4] and [len(q.draft_token_ids) for q in vreqs] == [2, 0, 0]
    passes = [0.08, 0.03, 0.03, 0.03]
    results = [VerifyResult([7, 9, 9, 9, 9], 1, 2, num_passes=4, passes_s=passes)] + \
        [VerifyResult([9, 9, 9, 9], 0, 0, num_passes=4, passes_s=passes) for _ in range(2)]
    rnd.commit(results, None)
    rnd.observe_cost(0.19)  # the passes' 0.17 s and 0.02 s of call overhead
    assert ak._verify_by_batch[3].points == {5: pytest.approx(0.10)}
    assert ak._multi_step_pass[3] == 0.05  # plain calls' cost untouched
