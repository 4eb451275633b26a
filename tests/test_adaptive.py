"""Adaptive K: what its choices must achieve. It speculates where the measured costs and acceptance
say it pays, decodes plainly where they say it does not (never losing to K=0 by more than its
probes cost), probes to come back once the load allows, and never changes greedy output."""
import importlib.util
from pathlib import Path

import pytest

from conftest import make_engine, ragged_prompts
from specdec.adaptive import PROBE_EVERY, AdaptiveK
from specdec.metrics import SpecMetrics
from specdec.adaptive_costs import PLAIN_REFRESH_EVERY, Costs, DraftCost, curve_cost
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


def flat_then_steep(draft_1=0.004) -> AdaptiveK:
    """1 user: 5 tokens cost 1.2x one; 16 users: compute-bound, 32 tokens cost 1.9x 16."""
    ak = AdaptiveK(k_max=4)
    for _ in range(20):
        for b, x, y in ((1, 1, 0.050), (1, 2, 0.052), (1, 3, 0.055), (1, 5, 0.060), (16, 16, 0.20), (16, 32, 0.38)):
            ak.observe_verify(b, x, y)
        ak.observe_draft(1, 2, draft_1)
        ak.observe_draft(16, 1, 0.010)
    return ak


def load_sim():
    path = Path(__file__).resolve().parent.parent / "bench" / "adaptive_sim.py"
    spec = importlib.util.spec_from_file_location("adaptive_sim", path)
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    return sim


def test_speculates_where_verify_is_cheap_and_drafts_are_accepted():
    assert costs().choose([0.9], [8]) == [8]
    a, b = costs().choose([0.9, 0.9], [2, 8])  # each within its budget
    assert a == 2 and b > 2
    assert costs().choose([0.9], [0]) == [0]
    # the steeper the verify cost, the fewer drafts
    assert costs(per_token=0.05).choose([0.6], [8])[0] < costs(per_token=0.001).choose([0.6], [8])[0]


def test_plain_decoding_where_the_pass_is_compute_bound_or_acceptance_poor():
    ak = flat_then_steep()
    assert ak.choose([0.4], [4])[0] > 0  # alone, the pass is flat: K > 0 pays
    assert ak.choose([0.4] * 16, [4] * 16) == [0] * 16  # at 16 users it cannot
    assert costs(draft=0.03).choose([0.05], [8]) == [0]


def test_deeper_drafts_only_where_later_positions_are_accepted():
    ak = AdaptiveK(k_max=4)
    for _ in range(100):  # the first draft is accepted 60% of the time, later ones never
        ak.observe_round([(4, 1)] * 6 + [(4, 0)] * 4)
    a1, a2 = ak.position_acceptance()[:2]
    assert abs(a1 - 0.6) < 0.05 and a2 < 0.1
    for x, y in ((1, 0.050), (2, 0.052), (3, 0.054), (5, 0.058)):
        for _ in range(5):
            ak.observe_verify(1, x, y)
    assert ak.choose([ak.global_acceptance()], [4]) == [1]


def test_the_simulator_cases_never_lose_against_k0_and_gain_where_the_costs_allow():
    """bench/adaptive_sim.py: the H200's shape of costs (flat verify curve, launch-bound draft
    steps) with a code-like draft gains at 1 and 4 users and never loses at 16; this CPU's shape,
    Serve's (4-step plain calls, answers that differ), and a poor draft on either cost at most the
    probes' few % against K=0."""
    sim = load_sim()
    gpu = [sim.simulate("h200", 0.66, seed=seed) for seed in range(8)]
    assert all(sum(g[u]["vs_k0"] for g in gpu) / len(gpu) > 1.05 for u in (1, 4)), gpu
    assert all(g[16]["vs_k0"] > 0.99 for g in gpu) and any(g[16]["vs_k0"] > 1.03 for g in gpu), gpu
    cases = [("h200", 0.37, {}), ("cpu", 0.37, {}), ("cpu", 0.66, {}), ("serve-cpu", 0.2, {}),
             ("serve-cpu", 0.45, {"first_bonus": 0.12, "concentration": 3.0})]
    for name, a1, kw in cases:
        for seed in range(2):
            res = sim.simulate(name, a1, seed=seed, **kw)
            assert all(res[u]["vs_k0"] > 0.96 for u in (1, 4)) and res[16]["vs_k0"] > 0.99, (name, a1, res)
    assert sim.simulate("serve-cpu", 0.66)[1]["vs_k0"] > 1.05  # a good draft pays in Serve at 1 user


def test_adaptive_engine_is_lossless(tiny_target):
    plain = make_engine(tiny_target, k=0).generate(ragged_prompts()[:4], SamplingParams(max_tokens=30, ignore_eos=True))
    eng = make_engine(tiny_target, noisy_copy(tiny_target, 0.05), k=8)
    eng.adaptive = AdaptiveK(k_max=8)
    got = eng.generate(ragged_prompts()[:4], SamplingParams(max_tokens=30, ignore_eos=True))
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]


def test_the_in_process_engine_prices_its_drafts_as_local_until_measured(tiny_target):
    """Its proposers run in its own process: no draft is priced as a remote call's."""
    from specdec.config import EngineConfig
    from specdec.engine import SpecEngine

    eng = SpecEngine(make_engine(tiny_target, k=0).verifier, None, None, EngineConfig())
    assert eng.adaptive.costs.draft(1, 1) < AdaptiveK().costs.draft(1, 1) / 3


def test_probes_find_a_draft_that_got_better_and_cost_little_while_it_is_poor():
    """At K=0 the estimates are kept fresh by probes: rare while they find nothing (the draft's
    first guesses all rejected), and once its guesses are accepted the probes find it and
    speculation resumes, up to full depth."""
    ak, poor, good = costs(), [], []
    for _ in range(1000):
        ks = ak.choose([ak.acceptance(0, 0)], [8])
        ak.observe_round([(ks[0], 0)])
        poor.append(ks[0])
    assert 3 <= sum(k > 0 for k in poor) <= 20 and sum(k > 0 for k in poor[500:]) <= 3
    for _ in range(1000):
        ks = ak.choose([ak.acceptance(0, 0)], [8])
        ak.observe_round([(ks[0], ks[0])])
        good.append(ks[0])
    assert sum(k > 0 for k in good) > 300 and good[-1] == 8


def test_probes_wait_while_the_batch_is_compute_bound_and_come_back_after_load_falls():
    """At 16 users a probe would hold up the whole batch for a draft call and widen its pass,
    whatever it found: no probe, new request's or periodic. Once the load falls to one user, a
    new request is probed at once and the periodic probes resume."""
    ak = flat_then_steep(draft_1=0.02)
    assert ak.choose([0.05] * 16, [4] * 16, new=[True] + [False] * 15) == [0] * 16
    assert all(ak.choose([0.05] * 16, [4] * 16) == [0] * 16 for _ in range(3 * PROBE_EVERY))
    assert ak.choose([0.05], [4], new=[True]) == [2]
    assert any(ak.choose([0.05], [4])[0] for _ in range(PROBE_EVERY))


def test_every_new_request_is_probed_once_even_when_speculation_is_off():
    ak = costs()
    assert ak.choose([0.05], [8], new=[False]) == [0]
    assert ak.choose([0.05, 0.05], [8, 8], new=[False, True]) == [0, 2]  # only the new one drafts
    assert ak.choose([0.05, 0.05], [8, 1], new=[True, True]) == [2, 1]  # together, each within its budget


def four_users(verify_12: float) -> AdaptiveK:
    """Serve at 4 users as measured: 4-step plain calls 53 ms a pass, a one-pass call 58 ms at 6
    tokens, verify_12 at 12; a draft call 12-18 ms."""
    ak = AdaptiveK(k_max=8)
    for _ in range(20):
        ak.observe_verify(4, 4, 0.053, steps=4)
        for t, y in ((5, 0.056), (6, 0.058), (8, 0.062), (12, verify_12)):
            ak.observe_verify(4, t, y)
        ak.observe_draft(1, 2, 0.012)
        ak.observe_draft(4, 2, 0.018)
    return ak


def test_new_requests_are_probed_together_where_that_costs_less_than_one_at_a_time():
    """One probe round for four new requests (one call, one draft call) where that costs less
    than four lone one-pass calls in place of plain 4-step ones; one at a time where the pass
    for all their drafts costs far more."""
    assert four_users(0.075).choose([0.4] * 4, [8] * 4, new=[True] * 4) == [2, 2, 2, 2]
    assert four_users(0.4).choose([0.4] * 4, [8] * 4, new=[True] * 4) == [2, 0, 0, 0]


def test_users_arriving_together_are_not_probed_on_their_joint_optimism():
    """Sixteen new requests at a compute-bound batch: at most one probes, though all of them
    accepting well at once would look worth a round."""
    ak = AdaptiveK(k_max=4)
    for _ in range(20):
        ak.observe_verify(16, 16, 0.11, steps=4)
        ak.observe_verify(16, 20, 0.13)
        ak.observe_draft(16, 2, 0.02)
    assert sum(k > 0 for k in ak.choose([0.3] * 16, [4] * 16, new=[True] * 16)) <= 1


def test_a_bigger_batch_than_any_measured_is_probed_once_to_measure_it():
    """Its plain pass is borrowed from the nearest size measured, but its drafts are costed in
    proportion (it may be compute-bound), so K > 0 does not pay on the pessimistic cost; one new
    request's probe measures it."""
    ak = AdaptiveK()
    for _ in range(20):
        ak.observe_verify(4, 4, 0.08)
        ak.observe_verify(4, 8, 0.10)
        ak.observe_draft(4, 2, 0.004)
    assert ak.choose([0.6] * 8, [4] * 8) == [0] * 8
    assert ak.choose([0.6] * 8, [4] * 8, new=[True] + [False] * 7) == [2] + [0] * 7
    assert costs(draft=0.03).choose([0.05] * 3, [8] * 3, new=[True] * 3) == [2, 0, 0]


def test_lookup_drafts_are_judged_on_their_own_acceptance():
    """Prompt-lookup copies are free and accepted very differently from the model's drafts: a
    sequence with a match drafts by lookup while the model's drafts do not pay, and a match whose
    copies keep being rejected is not verified."""
    ak = costs(draft=0.03)
    for _ in range(50):
        ak.observe_round([(4, 0), (4, 4)], looked_up=[False, True])
    assert ak.global_acceptance() < 0.1 and ak.lookup.overall() > 0.9
    a, la = ak.acceptance(0, 40), ak.lookup.of_sequence(40, 40)
    assert ak.choose([a, a], [8, 8], lookups=[0, 6], lookup_acceptances=[la, la]) == [0, 6]
    # beside a good copy, the model's drafts must gain min_gain on their own, beyond the copy's
    assert costs().choose([0.82, 0.82], [8, 8]) == [4, 4]
    assert costs().choose([0.82, 0.82], [8, 8], lookups=[0, 6], lookup_acceptances=[0.5, 0.95]) == [0, 6]
    bad = AdaptiveK(k_max=8)
    for _ in range(50):
        bad.observe_round([(4, 0)], looked_up=[True])
        bad.observe_verify(1, 1, 0.05), bad.observe_verify(1, 5, 0.08)
    assert bad.choose([0.5], [8], lookups=[4], lookup_acceptances=[bad.lookup.of_sequence(0, 200)]) == [0]


def test_a_new_request_is_expected_to_accept_what_first_rounds_did():
    """One well-accepted answer that drafted deep dominates the overall estimate; a request with
    no record of its own leans on what first drafting rounds accepted."""
    ak = AdaptiveK(k_max=8)
    for _ in range(30):  # thirty requests' first rounds: one draft in four accepted
        ak.observe_round([(1, 1), (1, 0), (2, 0), (2, 0)], first=[True] * 4)
    for _ in range(40):
        ak.observe_round([(8, 8)])
    assert ak.global_acceptance() > 0.8
    assert ak.acceptance(0, 0) < 0.35 and ak.acceptance(40, 40) > 0.9  # its own record still wins


def test_a_draft_after_a_rejected_one_is_not_counted_against_its_request():
    """The verifier never judges a draft past the first it rejects: a probe of 4 drafts rejected
    at its first is one miss, for the request's record and for the overall rate."""
    m = SpecMetrics()
    m.record_round(4, 0)
    m.record_round(3, 1)
    assert (m.num_model_accepted, m.num_model_judged) == (1, 3)
    m.record_round(2, 2, lookup=True)  # all accepted: both judged, and counted apart as lookup's
    assert (m.num_model_judged, m.num_lookup_judged) == (3, 2)
    ak = AdaptiveK(k_max=8)
    assert ak.acceptance(0, 1) > ak.acceptance(0, 4)
    for _ in range(20):
        ak.observe_round([(4, 0), (4, 1)])
    assert ak.global_acceptance() == pytest.approx((20 + 0.5 * 8) / (60 + 8), rel=0.05)


def test_acceptance_does_not_drift_back_to_the_prior_at_k0():
    ak = costs()
    for _ in range(50):
        ak.observe_round([(4, 0)])
    low = ak.global_acceptance()
    for _ in range(1000):
        ak.observe_round([(0, 0)])
    assert low < 0.1 and ak.global_acceptance() == low


def test_predictions_that_run_high_stop_drafting_at_that_batch_size():
    """Two sequences whose records (0.6) are read against an overall rate that runs far lower: K=1
    for both is predicted ~1 accepted draft a round and one in eight comes. Calibrated, drafting
    stops after a few rounds; with the calibration held at 1 it goes on. One sequence is never
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
    assert drafting_rounds(1e12)[0] >= 95
    assert ak.calibration(1) == 1.0
    low = costs()
    for _ in range(20):
        low.observe_round([(4, 4)] * 2, predicted={"model_accepted_raw": 1.0})
    assert low.calibration(2) == 1.0


def test_a_fresh_server_decodes_plainly_before_it_speculates():
    """With multi-step plain calls a plain pass costs a share of a call: until one is measured,
    nothing drafts (priced as one-pass calls, plain decoding looks slow enough that drafting every
    round seems to pay, and then it is never measured), probes included."""
    ak = costs()  # one-pass calls: 0.06 s for 1 token, 0.005 s a token more
    assert ak.choose([0.6], [8]) != [0]  # without multi-step calls, drafting beats a whole call per token
    ak.multi_step = True
    assert ak.choose([0.6], [8]) == [0] and ak.choose([0.6], [8], new=[True]) == [0]
    ak.observe_verify(1, 1, 0.038, steps=4)
    assert ak.choose([0.6], [8]) == [0]  # against 0.038 s a token, 0.6 acceptance does not pay
    assert ak.choose([0.6], [8], new=[True]) == [2]  # a new request's probe may now find better


def test_no_speculation_at_a_batch_size_until_its_plain_pass_is_measured():
    """Plain 4-step passes measured at 1-4 users only and one-pass calls at 16: 16 users decode
    plainly (no probe either) until a plain pass there is measured; then K=1 at acceptance 0.3
    does not pay and at 0.95 it does."""
    ak = AdaptiveK(k_max=4)
    for _ in range(20):
        for b, y in ((1, 0.049), (3, 0.064), (4, 0.072)):
            ak.observe_verify(b, b, y, steps=4)
        for x in (18, 32):
            ak.observe_verify(16, x, 0.15)
        ak.observe_draft(16, 1, 0.025)
    assert ak.choose([0.95] * 16, [4] * 16) == [0] * 16
    assert ak.choose([0.3] * 16, [4] * 16, new=[True] * 16) == [0] * 16
    ak.observe_verify(16, 16, 0.12, steps=4)
    assert ak.choose([0.3] * 16, [4] * 16) == [0] * 16
    assert ak.choose([0.95] * 16, [4] * 16) != [0] * 16


def multi_step_costs(multi_step: bool) -> AdaptiveK:
    """Serve at 16 users as measured: 4-step plain calls 0.11 s a pass, one-pass calls 0.21 s at
    32 tokens and 0.28 s at 48 (each pays a whole call's overhead)."""
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


def test_a_one_pass_call_is_not_costed_as_a_share_of_a_multi_step_one():
    """Two long lookup matches must not turn a 4-step plain call into a one-pass one; costed as a
    share of a multi-step call, they would. Alone, a well-accepting sequence still speculates, a
    mediocre one does not."""
    lookups, sure = [0] * 14 + [4, 4], [1.0] * 16
    assert multi_step_costs(True).choose([0.3] * 16, [4] * 16, lookups=lookups, lookup_acceptances=sure) == [0] * 16
    assert multi_step_costs(False).choose([0.3] * 16, [4] * 16, lookups=lookups, lookup_acceptances=sure) != [0] * 16
    assert multi_step_costs(True).choose([0.3], [4]) == [0]
    assert multi_step_costs(True).choose([0.95], [4])[0] > 0


def test_a_stale_plain_cost_is_measured_again():
    """A plain pass measured while the machine was busy (0.12 s where it costs 0.09) makes K=1 for
    all sixteen look like a gain. Within PLAIN_REFRESH_EVERY rounds of speculating a round decodes
    plainly, its measurement replaces the stale one, and speculation stops."""
    ak = AdaptiveK(k_max=4)
    for _ in range(20):
        ak.observe_verify(16, 32, 0.13)
        ak.observe_draft(16, 1, 0.02)
    ak.observe_verify(16, 16, 0.12, steps=4)  # measured while busy
    acc = [0.6] * 16
    rounds = [ak.choose(acc, [4] * 16) for _ in range(PLAIN_REFRESH_EVERY + 1)]
    assert rounds[0] == [1] * 16 and rounds[-1] == [0] * 16
    ak.observe_verify(16, 16, 0.09, steps=4)
    assert ak.choose(acc, [4] * 16) == [0] * 16
    assert ak.state()["multi_step_pass_s"][16] == 0.09


def test_prefilling_rounds_get_no_probe_and_with_multi_step_calls_no_drafts():
    """A pass that prefills a prompt is not costed, so a probe there measures nothing: it waits
    for the next round. With multi-step calls nothing drafts there (a draft would cut every
    sequence's plain steps to one); in-process a well-accepting sequence may still draft."""
    ak = costs()
    for _ in range(50):
        ak.observe_round([(2, 0)], first=[True])  # new requests' first drafts mostly rejected
    assert ak.choose([0.05, 0.05], [8, 0], new=[True, False], prefilling=True) == [0, 0]
    assert ak.choose([0.05, 0.05], [8, 0], new=[True, False]) == [2, 0]
    assert all(ak.choose([0.05], [8], prefilling=True) == [0] for _ in range(2 * PROBE_EVERY))
    assert ak.choose([0.05], [8]) == [1]  # the periodic probe, once it can
    ms = costs()
    assert ms.choose([0.9, 0.5], [8, 0], prefilling=True)[0] > 0
    ms.observe_verify(2, 2, 0.05, steps=4)
    assert ms.choose([0.9, 0.5], [8, 0], prefilling=True) == [0, 0]
    assert ms.choose([0.9, 0.5], [8, 0])[0] > 0


def test_a_probe_is_not_justified_by_hope_at_a_depth_it_would_not_measure():
    """Serve at 4 users: 4-step plain passes 0.063 s, a one-pass call with a 2-draft probe 0.099 s.
    Were costs past 6 tokens read hopefully at every K, a deep K would seem to pay and every new
    request would be probed; at acceptance 0.3 none is."""
    ak = AdaptiveK(k_max=8)
    ak.observe_verify(4, 4, 0.063, steps=4)
    ak.observe_verify(1, 1, 0.047, steps=4)
    for _ in range(10):
        ak.observe_verify(4, 6, 0.099)
        for t in (1, 3, 5, 9):
            ak.observe_verify(1, t, 0.06 + 0.004 * t)
        ak.observe_draft(1, 2, 0.02)
    assert ak.choose([0.3] * 4, [8] * 4, new=[True, False, False, False]) == [0] * 4


def test_on_a_gpu_a_big_batch_probes_and_then_speculates_and_on_this_cpu_stays_off():
    """Draft calls seen at 1 user only and no 16-user pass longer than 18 tokens: a probe is
    priced hopefully (the measured curve's slope, a draft step costing the same for 16 sequences
    as for 1). On GPU-shaped costs what it measures makes K > 0 pay; on this CPU's it is made at
    most once and speculation stays off."""
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
        for _ in range(3 * PROBE_EVERY):
            ks = ak.choose([0.7] * 16, [4] * 16)
            if any(ks):
                ak.observe_verify(16, 16 + sum(ks), verify(16 + sum(ks)) * 1.05)
                ak.observe_draft(16, max(ks), draft(16, max(ks)))
            chosen.append(max(ks))
        return chosen

    gpu = run(lambda t: 0.0075 + 0.00002 * t, lambda b, k: 0.001 + 0.0016 * k + 0.00002 * b * k)
    assert gpu[0] == 0 and gpu[-1] > 0
    cpu = run(lambda t: 0.05 + 0.005 * t, lambda b, k: 0.015 + 0.004 * b * k)
    assert sum(k > 0 for k in cpu) <= 1 and cpu[-1] == 0


def test_a_probe_rides_along_a_plain_call_and_is_costed_by_its_own_pass():
    """With multi-step calls a probe's drafts go in the call's first pass and every sequence then
    decodes its plain steps. Adaptive K learns such a call as the one-pass call it stands for (its
    first pass plus the call's overhead), and plain calls' cost stays as measured."""
    from specdec.protocol import Proposal, VerifyResult
    from specdec.rounds import Round
    from specdec.sequence import Sequence

    ak = costs()
    ak.observe_verify(3, 3, 0.05, steps=4)  # 4-step plain calls measured at 3 sequences
    seqs = [Sequence(f"s{i}", [1, 2, 3], SamplingParams(max_tokens=40), 8, 512) for i in range(3)]
    for s in seqs:
        s.commit(VerifyResult([5], 0, 0))  # past their prefill, no draft verified yet
    rnd = Round(seqs, {s.seq_id: "draft" for s in seqs}, ak)
    assert ak.last_probe and rnd.ks == [2, 0, 0]  # 3 sequences never drafted for: one probe
    [(idx, reqs)] = rnd.propose_requests().values()
    rnd.set_proposals(idx, [Proposal([7] * q.num_speculative_tokens, None) for q in reqs], 0.0)
    vreqs = rnd.verify_requests(decode_steps=4)
    assert [q.num_steps for q in vreqs] == [4, 4, 4] and [len(q.draft_token_ids) for q in vreqs] == [2, 0, 0]
    passes = [0.08, 0.03, 0.03, 0.03]
    results = [VerifyResult([7, 9, 9, 9, 9], 1, 2, num_passes=4, passes_s=passes)] + \
        [VerifyResult([9, 9, 9, 9], 0, 0, num_passes=4, passes_s=passes) for _ in range(2)]
    rnd.commit(results, None)
    rnd.observe_cost(0.19)  # the passes' 0.17 s and 0.02 s of call overhead
    state = ak.state()
    assert state["verify_s_by_batch"][3] == {5: pytest.approx(0.10)} and state["multi_step_pass_s"][3] == 0.05


def test_a_request_near_its_end_is_not_probed():
    from specdec.rounds import Round
    from specdec.sequence import Sequence

    def probe_k(room: int) -> int:
        ak = costs()
        for _ in range(50):
            ak.observe_round([(2, 0)], first=[True])
        s = Sequence("s", [5, 6, 7, 8], SamplingParams(max_tokens=3 + room, ignore_eos=True), 8, 4096)
        s.output_ids = [9] * 3
        s.tokens += s.output_ids
        return Round([s], {"s": "draft"}, ak).ks[0]

    assert probe_k(40) == 2 and probe_k(AdaptiveK.probe_min_room - 1) == 0


def test_the_draft_cost_tells_a_per_step_cost_from_a_per_sequence_one():
    """A draft call costs a + b K + c K B. From calls at one batch size b and c cannot be told
    apart: a probe hopes for the per-step case (a GPU's launch-bound draft), choices keep the line
    in K x B. From calls at two, a probe is priced as measured; from two (K, B) points only, the
    fit keeps to the terms they determine."""
    gpu, cpu = DraftCost(0.002, 0.0015), DraftCost(0.002, 0.0015)
    for _ in range(30):
        for k in (1, 2, 4, 8):
            gpu.observe(1, k, 0.001 + 0.0016 * k)
            cpu.observe(1, k, 0.015 + 0.004 * k)
    assert abs(gpu(16, 2) - (0.001 + 0.0016 * 32)) < 2e-3
    assert abs(gpu.optimistic(16, 2) - gpu(1, 2)) < 1e-9
    for _ in range(30):
        for k in (1, 2):
            gpu.observe(4, k, 0.001 + 0.0016 * k + 0.00002 * 4 * k)
            cpu.observe(4, k, 0.015 + 0.004 * 4 * k)
    assert abs(gpu.optimistic(16, 2) - (0.001 + 0.0032 + 0.00064)) < 5e-4
    assert abs(cpu.optimistic(16, 2) - (0.015 + 0.004 * 32)) < 2e-3
    few = DraftCost(0.002, 0.0015)
    for _ in range(20):
        few.observe(1, 2, 0.015 + 0.004 * 2)
    few.observe(16, 1, 0.015 + 0.004 * 16)
    assert few.coef() is not None and all(abs(v) < 1 for v in few.coef())
    assert abs(few.optimistic(16, 1) - 0.079) < 1e-3 and abs(few.optimistic(1, 2) - 0.023) < 1e-3


def test_verify_costs_follow_measurements_and_borrow_from_the_nearest_batch_size():
    """Linear between sizes measured; outside, the prior's shape through the nearest measurement.
    An unmeasured batch size borrows the nearest curve, scaled as the two sizes' plain passes
    compare where both were measured, and its draft tokens cost in proportion above it."""
    assert abs(curve_cost({}, 5) - 0.11) < 1e-9  # nothing seen yet: the prior
    pts = {16: 0.15, 32: 0.25}
    assert abs(curve_cost(pts, 24) - 0.20) < 1e-9 and abs(curve_cost(pts, 8) - 0.15 * 0.14 / 0.22) < 1e-9
    assert curve_cost(pts, 64) > curve_cost(pts, 64, optimistic=True) == pytest.approx(0.25 + 32 * 0.1 / 16)
    c = Costs()
    for x, y in ((4, 0.08), (8, 0.10)):
        c.observe_verify(4, x, y, steps=1, now=0)
    assert abs(c.verify(2, 4) - 0.10 / 2) < 1e-9 and abs(c.verify(8, 8) - 2 * 0.08) < 1e-9
    assert abs(c.verify(8, 16) - 2 * 0.08 * 2) < 1e-9  # not the flat curve's 2 * 0.10
    c.observe_verify(4, 4, 0.06, steps=4, now=0)
    c.observe_verify(8, 8, 0.09, steps=4, now=0)
    assert abs(c.verify(8, 8) - 0.08 * 0.09 / 0.06) < 1e-9


def test_a_verify_cost_point_no_choice_goes_back_to_is_dropped():
    """One slow measurement (a busy moment, a first pass) at a size that then looks too dear to
    choose would price it out for good; once other sizes have been measured for CURVE_FORGET
    choices it is dropped, and its cost is read from the fresh points around it."""
    from specdec.adaptive_costs import CURVE_FORGET

    c = Costs()
    c.observe_verify(1, 3, 0.018, steps=1, now=0)  # slow once
    for now in range(1, CURVE_FORGET + 2):
        c.observe_verify(1, 2, 0.010, steps=1, now=now)
        c.observe_verify(1, 5, 0.012, steps=1, now=now)
    assert 3 not in c.curves[1]
    assert c.verify(1, 3) == pytest.approx(0.010 + 0.002 / 3)
