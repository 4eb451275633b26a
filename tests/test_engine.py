"""End to end on tiny random models: lossless greedy, reproducible sampling, exact cache rollback."""
import pytest
import torch

from conftest import assert_cache_equals_fresh_recompute, make_engine, ragged_prompts
from specdec.models.runner import ContextLengthError
from specdec.models.tiny import noisy_copy
from specdec.proposers import NgramProposer
from specdec.proposers.ngram import SuffixIndex
from specdec.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_target):
    eng = make_engine(tiny_target, k=0)
    return {tuple(p): c.token_ids for p, c in zip(ragged_prompts(), eng.generate(ragged_prompts(), GREEDY))}


def test_our_plain_decoding_equals_hf_generate():
    """Our forward is a re-implementation: check it against transformers on the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models.llama import ModelArgs, Transformer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2)
    hf = LlamaForCausalLM(cfg).eval()
    ours = Transformer(ModelArgs.from_hf(cfg))
    ours.load_hf_state_dict(hf.state_dict())
    prompt = [5, 17, 42, 7, 99, 3]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, 6:].tolist()
    got = make_engine(ours.eval(), k=0).generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert got.token_ids == ref


@pytest.mark.parametrize("noise,k", [(0.05, 4), (0.3, 3), (1.0, 5), (0.3, 1)])
def test_greedy_speculative_equals_plain_bs1(tiny_target, plain, noise, k):
    eng = make_engine(tiny_target, noisy_copy(tiny_target, noise), k=k)
    for p in ragged_prompts()[:3]:
        assert eng.generate([p], GREEDY)[0].token_ids == plain[tuple(p)]


@pytest.mark.parametrize("noise", [0.05, 0.5])
def test_greedy_speculative_equals_plain_ragged_batch(tiny_target, plain, noise):
    eng = make_engine(tiny_target, noisy_copy(tiny_target, noise), k=4)
    prompts = ragged_prompts()
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [plain[tuple(p)] for p in prompts]
    assert eng.stats()["max_batch_size"] == 8  # one verifier pass really held all eight
    accepted = sum(o.metrics.num_accepted for o in outs)
    assert 0 < accepted < sum(o.metrics.num_drafted for o in outs)  # both paths exercised


def test_ngram_greedy_equals_plain(tiny_target, plain):
    eng = make_engine(tiny_target, k=4, proposer=NgramProposer())
    prompts = [p * 3 for p in ragged_prompts()[:4]]  # repeated text gives lookup something to find
    want = make_engine(tiny_target, k=0).generate(prompts, GREEDY)
    got = eng.generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_ngram_lookup_matches_a_plain_scan():
    """The vectorised lookup returns what a direct scan does: longest suffix, latest occurrence."""
    import random

    def scan(tokens, k, max_n, min_n):
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tokens[-n:]:
                    return tokens[start + n : start + n + k] if k > 0 else []
        return []

    r = random.Random(0)
    for _ in range(2000):
        toks = [r.randint(0, 4) for _ in range(r.randint(0, 40))]
        max_n = r.randint(1, 5)
        min_n, k = r.randint(1, max_n), r.randint(0, 5)
        assert NgramProposer(max_n, min_n).lookup(toks, k) == scan(toks, k, max_n, min_n)


def test_a_sequences_lookup_index_finds_what_the_scan_does_as_it_grows():
    """A sequence's SuffixIndex, fed its growing tokens round after round (1-4 at a time, as
    rounds accept them), returns what the stateless lookup does at every length."""
    import random

    r = random.Random(1)
    for _ in range(300):
        max_n = r.randint(1, 5)
        min_n = r.randint(1, max_n)
        ngram, toks = NgramProposer(max_n, min_n), [r.randint(0, 4) for _ in range(r.randint(1, 20))]
        index = ngram.index()
        while len(toks) < 60:
            k = r.randint(0, 5)
            assert index.lookup(toks, k) == ngram.lookup(toks, k)
            toks = toks + [r.randint(0, 4) for _ in range(r.randint(1, 4))]


def test_prompt_lookup_before_the_draft_is_lossless_and_used(tiny_target, monkeypatch):
    """With lookup first, sequences whose suffix recurs draft by lookup (no draft-model call for
    them that round), the rest by the draft model; greedy output is still the verifier's."""
    prompts = [p * 3 for p in ragged_prompts()[:4]]
    want = make_engine(tiny_target, k=0).generate(prompts, GREEDY)
    eng = make_engine(tiny_target, noisy_copy(tiny_target, 0.3), k=4)
    assert eng.lookup is not None and eng.lookup.min_n == 3
    hits, calls = [], []
    lookup, propose = SuffixIndex.lookup, eng.proposers["draft"].propose
    monkeypatch.setattr(SuffixIndex, "lookup", lambda self, t, k: hits.append(bool(r := lookup(self, t, k))) or r)
    eng.proposers["draft"].propose = lambda reqs: calls.append(len(reqs)) or propose(reqs)
    got = eng.generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert any(hits) and calls  # both proposers drafted
    assert sum(calls) == hits.count(False)  # the draft model saw exactly the sequences lookup missed


def test_high_agreement_draft_accepts_most(tiny_target):
    eng = make_engine(tiny_target, noisy_copy(tiny_target, 0.0), k=4)
    m = eng.generate(ragged_prompts()[:2], GREEDY)[0].metrics
    assert m.acceptance_rate == 1.0 and m.mean_accepted_length > 4


def test_seeded_sampling_is_reproducible(tiny_target):
    draft = noisy_copy(tiny_target, 0.3)
    sp = lambda seed: SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)  # noqa: E731
    a = make_engine(tiny_target, draft, k=3).generate(ragged_prompts()[:3], [sp(1), sp(2), sp(3)])
    b = make_engine(tiny_target, draft, k=3).generate(ragged_prompts()[:3], [sp(1), sp(2), sp(3)])
    c = make_engine(tiny_target, draft, k=3).generate(ragged_prompts()[:3], [sp(7), sp(8), sp(9)])
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_rollback_leaves_cache_equal_to_fresh_recompute(tiny_target):
    eng = make_engine(tiny_target, noisy_copy(tiny_target, 0.5), k=4)
    seqs = [eng.add_request(p, GREEDY) for p in ragged_prompts()[:3]]
    for _ in range(6):
        eng.step()
    assert sum(s.metrics.num_drafted - s.metrics.num_accepted for s in seqs) > 0  # rejections happened
    held = assert_cache_equals_fresh_recompute(eng.verifier.runner, seqs, tiny_target)
    # everything but the newest token, rejected drafts overwritten
    assert all(n >= len(s.tokens) - 1 for n, s in zip(held, seqs))


def test_eviction_rebuilds_from_tokens(tiny_target, plain):
    """Four sequences through two cache slots, rotated every round: each round evicts, and
    outputs stay exact because evicted caches are rebuilt from the token lists."""
    eng = make_engine(tiny_target, noisy_copy(tiny_target, 0.2), k=3, max_seqs=2, max_batch=2)
    prompts = ragged_prompts()[:4]
    seqs = [eng.add_request(p, GREEDY) for p in prompts]
    while eng.active:
        eng.step()
        eng.active.append(eng.active.pop(0)) if eng.active else None
    assert [s.output_ids for s in seqs] == [plain[tuple(p)] for p in prompts]
    assert eng.verifier.runner.evictions > 0


def test_streamed_text_is_the_outputs_text_however_rounds_split_it(tiny_tok):
    """Text is decoded a window at a time; its deltas join into exactly the whole output decoded
    at once, characters of 2-4 bytes split across rounds and a special token skipped included."""
    import random

    from specdec.protocol import VerifyResult
    from specdec.sequence import Sequence

    ids = tiny_tok.encode("Grüße, 世界! 🙂👍 naïve café — ok. ") * 3
    ids[20:20] = tiny_tok.encode("<|im_start|>")
    r = random.Random(0)
    for _ in range(20):
        seq = Sequence("s", [1], SamplingParams(max_tokens=len(ids)), 0, 4096, decode=tiny_tok.decode)
        i, deltas = 0, []
        while i < len(ids):
            n = r.randint(1, 5)
            deltas.append(seq.commit(VerifyResult(ids[i : i + n], 0, 0)).text)
            i += n
        assert "".join(deltas) == seq.text == tiny_tok.decode(ids)


def test_stop_conditions(tiny_target, tiny_tok, plain):
    p = ragged_prompts()[0]
    ref = plain[tuple(p)]
    eng = make_engine(tiny_target, noisy_copy(tiny_target, 0.05), k=4, tok=tiny_tok)
    # EOS (here a stop token id) in the middle of an accepted block: nothing after it is emitted
    c = eng.generate([p], SamplingParams(max_tokens=40, stop_token_ids=[ref[10]]))[0]
    assert c.token_ids == ref[: ref.index(ref[10])] and c.finish_reason == "stop"
    # max_tokens cuts exactly
    c = eng.generate([p], SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert c.token_ids == ref[:7] and c.finish_reason == "length"
    # stop string: text ends before it, and no token after the one completing it is kept
    text = tiny_tok.decode(ref)
    stop = text[12:14]
    c = eng.generate([p], SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True))[0]
    assert c.finish_reason == "stop" and c.text == text[: text.find(stop)]
    assert stop not in c.text and stop in tiny_tok.decode(c.token_ids)
    assert stop not in tiny_tok.decode(c.token_ids[:-1])


def test_context_limit(tiny_target):
    eng = make_engine(tiny_target, noisy_copy(tiny_target, 0.1), k=4, max_len=64)
    with pytest.raises(ContextLengthError):
        eng.add_request(list(range(3, 70)), GREEDY)
    c = eng.generate([list(range(3, 60))], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 64 - 57


def test_metrics_reported(tiny_target):
    eng = make_engine(tiny_target, noisy_copy(tiny_target, 0.3), k=4)
    m = eng.generate(ragged_prompts()[:1], GREEDY)[0].metrics.to_dict()
    for key in ("num_drafted", "num_accepted", "acceptance_rate", "mean_accepted_length", "accepted_per_position",
                "num_verifier_passes", "tokens_per_s", "ttft_s", "ms_per_output_token"):
        assert key in m
    assert m["num_output_tokens"] == 40
    assert m["mean_accepted_length"] == pytest.approx(1 + m["num_accepted"] / m["num_verifier_passes"], abs=1e-3)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=13, ignore_eos=True),
                                    SamplingParams(max_tokens=13, ignore_eos=True, temperature=0.9, seed=7)],
                         ids=["greedy", "sampled"])
def test_multi_step_decoding_equals_single_steps(tiny_target, params):
    from specdec.rounds import Round

    prompts = ragged_prompts(5)
    want = make_engine(tiny_target, k=0).generate(prompts, params)
    eng = make_engine(tiny_target, k=0)
    seqs = [eng.add_request(p, params) for p in prompts]
    calls = 0
    while any(not s.finished for s in seqs):
        rnd = Round([s for s in seqs if not s.finished], eng._proposer_of, None)
        rnd.commit(eng.verifier.verify(rnd.verify_requests(decode_steps=4)), 0.0)
        calls += 1
    assert [s.output_ids for s in seqs] == [w.token_ids for w in want]
    assert calls == 4  # 13 tokens in steps of 4, capped by what may still be emitted
    assert all(s.metrics.num_verifier_passes == 13 for s in seqs)


class Oracle:
    """Drafts the continuation plain greedy decoding gives, its last draft wrong: some drafts are
    accepted and some rejected in every pass."""

    name = "oracle"

    def __init__(self):
        self.full: dict[str, list[int]] = {}  # seq id -> prompt + greedy output

    def propose(self, reqs):
        from specdec.protocol import Proposal

        out = []
        for r in reqs:
            want = self.full[r.seq_id][len(r.tokens) : len(r.tokens) + r.num_speculative_tokens]
            out.append(Proposal(want[:-1] + [(want[-1] + 1) % 256] if want else [], None))
        return out

    def free(self, seq_id):
        pass


def test_calls_that_draft_in_the_verifier_emit_plain_greedy_decoding(tiny_target):
    """Serve with a draft head: the verifier drafts before each pass of a multi-pass call. The
    output is plain greedy decoding's, each pass is recorded as a round, and no sequence emits
    past what it may."""
    from specdec.rounds import Round

    params = SamplingParams(max_tokens=13, ignore_eos=True)
    prompts = ragged_prompts(5)
    want = make_engine(tiny_target, k=0).generate(prompts, params)
    oracle = Oracle()
    eng = make_engine(tiny_target, k=3, proposer=oracle)
    eng.verifier.drafter = oracle
    seqs = [eng.add_request(p, params) for p in prompts]
    for s, w in zip(seqs, want):
        oracle.full[s.seq_id] = s.tokens + w.token_ids
    calls = 0
    while live := [s for s in seqs if not s.finished]:
        rnd = Round(live, eng._proposer_of, None, None, frozenset({"oracle"}))
        rnd.commit(eng.verifier.verify(rnd.verify_requests(decode_steps=4, prefill_steps=1)), 0.0)
        calls += 1
    assert [s.output_ids for s in seqs] == [w.token_ids for w in want]
    m = [s.metrics for s in seqs]
    assert all(0 < x.num_accepted < x.num_drafted for x in m)
    # a pass each round: the prefill, then passes of up to 3 tokens (2 drafts accepted, 1 recovered)
    assert all(5 <= x.num_verifier_passes < 13 for x in m) and calls < 5
    assert all(x.drafted_per_position[0] >= 3 for x in m)  # each pass recorded as a round


def test_a_round_that_prefills_takes_prefill_steps(tiny_target):
    """Serve streams a call's tokens when it returns: the round that prefills a new prompt runs
    one step (its first token goes out after the prefill), later rounds decode_steps, and the
    tokens are the same."""
    from specdec.rounds import Round

    params = SamplingParams(max_tokens=13, ignore_eos=True)
    prompts = ragged_prompts(3)
    want = make_engine(tiny_target, k=0).generate(prompts, params)
    eng = make_engine(tiny_target, k=0)
    seqs = [eng.add_request(p, params) for p in prompts]
    emitted = []
    while any(not s.finished for s in seqs):
        rnd = Round([s for s in seqs if not s.finished], eng._proposer_of, None)
        rnd.commit(eng.verifier.verify(rnd.verify_requests(decode_steps=4, prefill_steps=1)), 0.0)
        emitted.append(len(seqs[0].output_ids))
    assert [s.output_ids for s in seqs] == [w.token_ids for w in want]
    assert emitted == [1, 5, 9, 13]


def test_ragged_forward_runs_real_tokens_only_and_equals_one_by_one(tiny_target):
    """A ragged batch (some sequences 1 token, some 4) runs its matmuls over the real tokens only
    (BatchIndex.rows) and gives each sequence what a forward of it alone gives."""
    from specdec.models.runner import ModelRunner

    ctxs = ragged_prompts(4)
    new = [[5], [6, 7, 8, 9], [10], [11, 12, 13]]
    ids = [f"s{i}" for i in range(4)]
    together = ModelRunner(tiny_target, 4, 512)
    together.sync(ids, [c + [0] for c in ctxs], [0] * 4)
    together.prefill(ids, ctxs)
    seen = []
    real = tiny_target.layers[0].wqkv.forward
    tiny_target.layers[0].wqkv.forward = lambda x: seen.append(x.shape[0]) or real(x)
    try:
        hidden, valid = together.forward(ids, new)  # [4, 4, dim], [4, 4]
    finally:
        del tiny_target.layers[0].wqkv.forward
    assert seen == [sum(map(len, new))]  # 9 rows through the matmul, not 4 x 4
    for i, (sid, c, x) in enumerate(zip(ids, ctxs, new)):
        alone = ModelRunner(tiny_target, 1, 512)
        alone.sync([sid], [c + [0]], [0])
        alone.prefill([sid], [c])
        h, _ = alone.forward([sid], [x])
        torch.testing.assert_close(hidden[i, : len(x)], h[0], atol=1e-5, rtol=1e-4)
        assert not hidden[i, len(x):].any()  # padding comes back as zeros
    assert_cache_equals_fresh_recompute(together, [_Seq(s, c + x) for s, c, x in zip(ids, ctxs, new)], tiny_target)


class _Seq:
    def __init__(self, seq_id, tokens):
        self.seq_id, self.tokens = seq_id, tokens


def test_cache_rows_start_zero_and_outlive_their_mapping_handle():
    import gc

    from specdec.models.runner import _zeros

    for dtype in (torch.float32, torch.bfloat16):
        x = _zeros((3, 2, 5, 4), torch.device("cpu"), dtype)
        gc.collect()  # the tensor alone must keep its memory alive
        assert x.shape == (3, 2, 5, 4) and x.dtype == dtype and x.is_contiguous() and not x.any()
        x[1, :, 2] = 7
        assert x.sum().item() == 7 * 2 * 4


def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] log-probabilities of a fresh one-pass forward over prompt + output: row j
    is the distribution output[j] was drawn from."""
    from specdec.models.runner import ModelRunner

    fresh = ModelRunner(model, 2, 512, prefix_caching=False)
    toks = prompt + output[:-1]
    fresh.sync(["ref"], [toks + [0]], [0])
    hidden, valid = fresh.forward(["ref"], [toks])  # [1, T, dim]
    return torch.log_softmax(model.logits(hidden[valid]).float(), -1)[len(prompt) - 1 :]


@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_are_the_verifiers_whatever_the_round_shape(tiny_target, sampled):
    """Each output token's log-probability (and its likeliest alternatives) is the verifier's own
    at that position, equal to a fresh one-pass recompute, whether the token came from a verify
    pass over drafts (accepted, recovered or bonus), a plain step, or a multi-step call."""
    from specdec.rounds import Round

    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=3, temperature=0.8 if sampled else 0.0, seed=5)
    prompts = ragged_prompts(3)
    spec = make_engine(tiny_target, noisy_copy(tiny_target, 0.3), k=4).generate(prompts, params)
    assert sum(c.metrics.num_accepted for c in spec) > 0  # drafts were accepted and others rejected
    eng = make_engine(tiny_target, k=0)  # ... and 4-step plain calls
    seqs = [eng.add_request(p, params) for p in prompts]
    while any(not s.finished for s in seqs):
        rnd = Round([s for s in seqs if not s.finished], eng._proposer_of, None)
        rnd.commit(eng.verifier.verify(rnd.verify_requests(decode_steps=4)), 0.0)
    for p, c, s in zip(prompts, spec, seqs):
        for out, lps in ((c.token_ids, c.logprobs), (s.output_ids, s.logprobs)):
            ref = reference_logprobs(tiny_target, p, out)  # [n, V]
            assert len(lps) == len(out) == 20
            assert [t.token_id for t in lps] == out
            torch.testing.assert_close(torch.tensor([t.logprob for t in lps]), ref[torch.arange(20), torch.tensor(out)],
                                       atol=1e-4, rtol=0)
            for t, row in zip(lps, ref):
                assert [i for i, _ in t.top] == row.topk(3).indices.tolist()
                torch.testing.assert_close(torch.tensor([v for _, v in t.top]), row.topk(3).values, atol=1e-4, rtol=0)
                if not sampled:
                    assert t.top[0][0] == t.token_id  # greedy: the token is its row's argmax
    if not sampled:
        assert [c.token_ids for c in spec] == [s.output_ids for s in seqs]


def test_logprobs_follow_the_kept_tokens_through_stops():
    """A stop token is not emitted and neither is its logprob; tokens cut after a stop string lose
    theirs; a request without logprobs carries none."""
    from specdec.protocol import TokenLogprob, VerifyResult
    from specdec.sequence import Sequence

    def lp(t):
        return TokenLogprob(t, -float(t), [(t, -float(t))])

    decode = lambda ids: "".join(chr(96 + t) for t in ids)  # 1 -> 'a', 2 -> 'b', ...
    s = Sequence("a", [1, 2], SamplingParams(max_tokens=10, stop=["cd"], logprobs=1), 4, 64, {9}, decode)
    d = s.commit(VerifyResult([1, 2], 1, 1, logprobs=[lp(1), lp(2)]))
    assert [t.token_id for t in d.logprobs] == [1, 2] and d.text == "ab"
    d = s.commit(VerifyResult([3, 4, 5], 2, 2, logprobs=[lp(3), lp(4), lp(5)]))  # 'cd' completes at 4: 5 is cut
    assert s.output_ids == [1, 2, 3, 4] and [t.token_id for t in s.logprobs] == [1, 2, 3, 4]
    assert [t.token_id for t in d.logprobs] == [3, 4] and s.finish_reason == "stop"
    s = Sequence("b", [1], SamplingParams(max_tokens=10, logprobs=0), 4, 64, {9}, decode)
    d = s.commit(VerifyResult([6, 9, 7], 2, 2, logprobs=[lp(6), lp(9), lp(7)]))  # EOS (9) ends it
    assert [t.token_id for t in s.logprobs] == [6] and [t.token_id for t in d.logprobs] == [6]
    s = Sequence("c", [1], SamplingParams(max_tokens=10), 4, 64, {9}, decode)
    assert s.commit(VerifyResult([6], 0, 0)).logprobs is None and s.logprobs is None


def test_prompt_logprobs_equal_a_fresh_recompute_and_leave_the_prompt_cached(tiny_target):
    """A scored prompt (completions' echo with logprobs): every position's logprobs, chunk by
    chunk, equal one fresh pass; generating from the same sequence next reuses its cached K/V
    and gives plain decoding's tokens."""
    prompt = ragged_prompts(8)[7]  # 38 tokens: 10 chunks of 4
    eng = make_engine(tiny_target, noisy_copy(tiny_target, 0.3), k=4)
    lps = eng.verifier.prompt_logprobs("s", prompt, 2, chunk=4)
    ref = reference_logprobs(tiny_target, prompt[:1], prompt[1:])  # [37, V]
    assert [t.token_id for t in lps] == prompt[1:]
    torch.testing.assert_close(torch.tensor([t.logprob for t in lps]), ref[torch.arange(37), torch.tensor(prompt[1:])],
                               atol=1e-4, rtol=0)
    assert [[i for i, _ in t.top] for t in lps] == ref.topk(2).indices.tolist()
    assert eng.verifier.runner.slots["s"].tokens == prompt[:-1]
    seq = eng.add_request(prompt, GREEDY, seq_id="s")
    while not seq.finished:
        eng.step()
    assert seq.output_ids == make_engine(tiny_target, k=0).generate([prompt], GREEDY)[0].token_ids


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=19, ignore_eos=True),
                                    SamplingParams(max_tokens=19, ignore_eos=True, temperature=0.9, seed=5)])
def test_drafts_then_plain_steps_in_one_call_equal_separate_rounds(tiny_target, params):
    """A probe riding along a multi-step call: one pass verifies some sequences' drafts, then
    every sequence decodes plain steps from where it stands (a verified one after its accepted
    drafts, the rejected ones' cache rows overwritten). Token for token what a one-step
    verifying round and then as many plain rounds give, greedy and seeded sampled alike."""
    from specdec.rounds import Round

    draft = noisy_copy(tiny_target, 0.3)
    prompts = ragged_prompts(4)
    engines = [make_engine(tiny_target, draft, k=3), make_engine(tiny_target, draft, k=3)]
    seqs = [[e.add_request(p, params, num_speculative_tokens=3 if i % 2 else 0) for i, p in enumerate(prompts)]
            for e in engines]
    (a, b), (sa, sb) = engines, seqs
    drafted = accepted = 0

    def drafting_round(eng, batch):
        rnd = Round(batch, eng._proposer_of, None)
        for name, (idx, reqs) in rnd.propose_requests().items():
            rnd.set_proposals(idx, eng.proposers[name].propose(reqs), 0.0)
        return rnd

    while not all(s.finished for s in sa):
        live_a, live_b = [s for s in sa if not s.finished], [s for s in sb if not s.finished]
        ra = drafting_round(a, live_a)
        ra.ride_along = True
        reqs = ra.verify_requests(decode_steps=4)
        results = a.verifier.verify(reqs)
        ra.commit(results, 0.0)
        drafted += sum(r.num_drafted for r in results)
        accepted += sum(r.num_accepted for r in results)
        rb = drafting_round(b, live_b)  # the same drafts (same tokens, same draft model), one step
        rb.commit(b.verifier.verify(rb.verify_requests(decode_steps=1)), 0.0)
        for _ in range(max(q.num_steps for q in reqs) - 1):  # then the plain steps, a round each
            todo = [s for s, q in zip(live_b, reqs) if not s.finished and q.num_steps > 1]
            if todo:
                rp = Round(todo, b._proposer_of, None)
                rp.commit(b.verifier.verify(rp.verify_requests(decode_steps=1)), 0.0)
            for s, q in zip(live_b, reqs):
                q.num_steps -= 1
    assert [s.output_ids for s in sa] == [s.output_ids for s in sb]
    assert 0 < accepted < drafted  # drafts accepted and rejected, then steps after both
    if params.greedy:
        assert [s.output_ids for s in sa] == [c.token_ids for c in make_engine(tiny_target, k=0).generate(prompts, params)]


def test_a_draft_head_that_raises_costs_its_passes_their_drafts_not_the_request(tiny_target):
    from specdec.rounds import Round

    class Broken(Oracle):
        def propose(self, reqs):
            raise RuntimeError("head down")

    params = SamplingParams(max_tokens=9, ignore_eos=True)
    want = make_engine(tiny_target, k=0).generate(ragged_prompts(2), params)
    broken = Broken()
    eng = make_engine(tiny_target, k=3, proposer=broken)
    eng.verifier.drafter = broken
    seqs = [eng.add_request(p, params) for p in ragged_prompts(2)]
    while live := [s for s in seqs if not s.finished]:
        rnd = Round(live, eng._proposer_of, None, None, frozenset({"oracle"}))
        rnd.commit(eng.verifier.verify(rnd.verify_requests(decode_steps=4, prefill_steps=1)), 0.0)
    assert [s.output_ids for s in seqs] == [w.token_ids for w in want]
    assert eng.verifier.draft_failures > 0 and all(s.metrics.num_drafted == 0 for s in seqs)


def test_a_call_drafts_one_past_the_run_its_last_pass_accepted():
    """No round re-plans K between a call's passes: after a pass that accepted nothing the next
    drafts one, after a full run one more than it, never past K or what may still be emitted."""
    from specdec.protocol import VerifyRequest, VerifyResult
    from specdec.verifier import Verifier

    def next_k(k, accepted, left, draft_passes=None):
        req = VerifyRequest("s", [1], [], None, SamplingParams(), 8, self_draft=k, draft_passes=draft_passes)
        return Verifier._next_k(req, VerifyResult([], 0, 0, per_pass=[(k, accepted, k)]), left)

    assert [next_k(6, 0, 99), next_k(6, 2, 99), next_k(6, 6, 99), next_k(6, 6, 4), next_k(2, 2, 99)] == [1, 3, 6, 3, 2]
    assert next_k(6, 6, 99, draft_passes=1) == 0  # a probe drafts in its first pass only
