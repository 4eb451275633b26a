"""Predicted Outputs: a request's expected output is copied as drafts where the output meets it,
verified as any draft is, so the output is the one decoding gives without it."""
import pytest

from conftest import make_engine, ragged_prompts
from specdec.proposers.ngram import predicted
from specdec.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=30, ignore_eos=True)


def test_a_prediction_is_met_where_the_output_is():
    p = [5, 6, 7, 8, 9, 10, 11]
    assert predicted(p, [], 3) == [5, 6, 7]  # nothing emitted yet: the prediction's start
    assert predicted(p, [5], 3) == [6, 7, 8]  # the output's start meets the prediction's start
    assert predicted(p, [5, 99], 3) == []  # an edit: no match of two tokens
    assert predicted(p, [5, 99, 8, 9], 3) == [10, 11]  # ... until the output rejoins the prediction
    assert predicted(p, [1, 2], 3) == []
    # a repeated pair: the occurrence nearest the output's own length, not the first
    assert predicted([1, 2, 3, 1, 2, 4, 1, 2, 5], [7] * 6 + [1, 2], 2) == [5]
    assert predicted([1, 2, 3, 1, 2, 4, 1, 2, 5], [1, 2], 2) == [3, 1]


@pytest.fixture(scope="module")
def plain(tiny_target):
    return make_engine(tiny_target, k=0).generate(ragged_prompts(4), GREEDY)


def edited(tokens: list[int], every: int = 7) -> list[int]:
    return [(t + 1) % 256 if i % every == every - 1 else t for i, t in enumerate(tokens)]


@pytest.mark.parametrize("proposer", [None, "ngram"])
def test_greedy_output_is_the_same_with_any_prediction(tiny_target, plain, proposer):
    """Without a model proposer too: the prediction is a proposer of its own."""
    from specdec.proposers import NgramProposer

    eng = make_engine(tiny_target, k=4, proposer=NgramProposer() if proposer else None)
    for p, ref in zip(ragged_prompts(4), plain):
        exact = eng.add_request(p, GREEDY, prediction=ref.token_ids)
        wrong = eng.add_request(p, GREEDY, prediction=edited(ref.token_ids))
        off = eng.add_request(p, GREEDY, num_speculative_tokens=0, prediction=ref.token_ids)
        while eng.active:
            eng.step()
        assert exact.output_ids == wrong.output_ids == off.output_ids == ref.token_ids
        m = exact.metrics
        assert m.num_prediction_accepted == m.num_prediction_drafted == m.num_accepted > 20
        assert m.num_verifier_passes <= 8  # 4 drafts and the bonus token a pass, after the prefill
        m = wrong.metrics
        assert 0 < m.num_prediction_accepted < m.num_prediction_drafted
        assert off.metrics.num_drafted == 0  # K=0 asks for no drafts, a prediction's included


def test_a_seeded_sampled_request_with_a_prediction_is_reproducible(tiny_target):
    """Sampled output follows the verifier's distribution with a prediction too
    (test_sampled_output.py); with its seed, the same request draws the same tokens again."""
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
    eng = make_engine(tiny_target, k=4)
    prompts = ragged_prompts(3)
    ahead = [c.token_ids for c in eng.generate(prompts, params)]
    a = eng.generate(prompts, params, predictions=[edited(x, 5) for x in ahead])
    b = eng.generate(prompts, params, predictions=[edited(x, 5) for x in ahead])
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert all(x.metrics.num_prediction_drafted > 0 for x in a)


class CountingHead:
    """A proposer in the verifier that drafts a wrong token and counts the times it is asked."""

    name = "head"

    def __init__(self):
        self.asked = 0

    def propose(self, reqs):
        from specdec.protocol import Proposal

        self.asked += len(reqs)
        return [Proposal([0] * r.num_speculative_tokens, None) for r in reqs]

    def free(self, seq_id):
        pass


def test_calls_that_draft_in_the_verifier_copy_the_prediction_in_every_pass(tiny_target, plain):
    """Serve's calls run several passes with the verifier's head drafting before each: a
    prediction is copied there too, the head drafting only where the copy finds no match."""
    from specdec.rounds import Round

    head = CountingHead()
    eng = make_engine(tiny_target, k=4, proposer=head)
    eng.verifier.drafter = head
    prompts = ragged_prompts(4)
    seqs = [eng.add_request(p, GREEDY, prediction=ref.token_ids[:20]) for p, ref in zip(prompts, plain)]
    while live := [s for s in seqs if not s.finished]:
        rnd = Round(live, eng._proposer_of, None, None, frozenset({"head"}))
        rnd.commit(eng.verifier.verify(rnd.verify_requests(decode_steps=4, prefill_steps=1)), 0.0)
    assert [s.output_ids for s in seqs] == [r.token_ids for r in plain]
    for s in seqs:  # the prediction's 20 tokens, but for the prefill's and the bonus tokens, drafted and kept
        assert s.metrics.num_prediction_accepted == s.metrics.num_prediction_drafted >= 15
        assert s.metrics.num_model_drafted > 0  # past the prediction, the head drafts
    assert head.asked > 0


def test_the_cli_reads_a_prediction_file(tmp_path, capsys):
    import json

    from specdec.cli import main

    args = ["generate", "--verifier", "tiny", "--draft", "none", "--prompt", "abc", "--raw", "--max-tokens", "12",
            "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    (tmp_path / "p.txt").write_text(plain["text"])
    assert main(args + ["--prediction-file", str(tmp_path / "p.txt")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain["token_ids"] and out["metrics"]["num_prediction_drafted"] > 0


def test_a_prediction_whose_copies_are_refused_gives_way_to_the_model():
    from specdec.adaptive import AdaptiveK
    from specdec.rounds import prediction_pays
    from specdec.sequence import Sequence

    s = Sequence("s", [1, 2], SamplingParams(), 4, 64, prediction=[3, 4, 5])
    ak = AdaptiveK(k_max=4)
    assert prediction_pays(ak, s)  # trusted before anything is known
    s.metrics.record_round(4, 0, lookup=True, predicted=True)
    s.metrics.record_round(4, 1, lookup=True, predicted=True)
    s.metrics.record_round(2, 1)  # the model's
    assert prediction_pays(ak, s)  # 1 of 3 judged, shrunk towards all kept: still 0.71 against 0.5
    for _ in range(6):
        s.metrics.record_round(4, 0, lookup=True, predicted=True)
    assert not prediction_pays(ak, s)


def test_a_prediction_shorter_than_the_match_harms_no_one(tiny_target, plain):
    """A prediction of fewer tokens than the longest match read (8) once made the lookup raise,
    failing the round for every sequence in the batch."""
    assert predicted([5, 6, 7], [5, 6, 7, 1, 2, 3, 4, 5, 6], 3) == [7]
    eng = make_engine(tiny_target, k=4)
    prompts = ragged_prompts(4)
    seqs = [eng.add_request(p, GREEDY, prediction=ref.token_ids[:2] if i % 2 else None)
            for i, (p, ref) in enumerate(zip(prompts, plain))]
    while eng.active:
        eng.step()
    assert [s.output_ids for s in seqs] == [r.token_ids for r in plain]
