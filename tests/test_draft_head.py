"""EAGLE-style draft head: tiny training run end to end, lossless greedy, argmax drafts (one-hot q) when sampling."""
import dataclasses

import pytest
import torch

from conftest import make_engine, ragged_prompts
from specdec.models.draft_head import DraftHead, DraftHeadConfig
from specdec.proposers.feature_head import FeatureHeadProposer
from specdec.sampling import SamplingParams


def _random_head(target, vocab=200, seed=0, feature_layers=()):
    torch.manual_seed(seed)
    a = target.args
    cfg = DraftHeadConfig(dim=a.dim, hidden_size=64, n_blocks=1, draft_vocab_size=vocab, vocab_size=a.vocab_size,
                          feature_layers=list(feature_layers))
    ids = torch.randperm(a.vocab_size)[:vocab].sort().values
    return DraftHead(cfg, ids).attach(target).eval()


def test_tiny_training_end_to_end(tmp_path, tiny_target):
    from specdec.train_draft import main

    out = tmp_path / "head"
    assert main(["--tiny", "--out", str(out), "--data-dir", str(tmp_path / "data"), "--quiet", "--threads", "2"]) == 0
    assert (out / "config.json").exists() and (out / "draft_head.safetensors").exists()
    head = DraftHead.load(out, tiny_target)
    assert head.cfg.train_info["steps"] > 0
    # trained over 128 tokens, it keeps the 96 most frequent of them
    assert head.cfg.draft_vocab_size == 96 == len(head.vocab_ids) and head.cfg.train_info["args"]["draft_vocab"] == 128
    assert head.cfg.feature_layers == [0] and head.fuse is not None  # 'auto': the tiny verifier's first layer
    data = torch.load(tmp_path / "data" / "data.pt", weights_only=False)
    assert data["feats"].shape[1] == 2 * tiny_target.args.dim  # layer 0's output, then the last layer's
    # the verifier wrote user turns of its own (a random model rarely ends one: none may be kept)
    assert data["meta"]["written_prompts"] == sum(c == "written" for c in data["doc_category"]) / 2 <= 4
    # the frozen parts come from the verifier, the trained part from the file
    assert head.embed_weight.data_ptr() == tiny_target.embed.weight.data_ptr()
    assert torch.equal(head.head_weight, tiny_target.lm_head.weight[head.vocab_ids])
    dev = tiny_target.embed.weight.device  # CPU, or SPECDEC_TEST_DEVICE's
    f = torch.randn(3, tiny_target.args.dim, device=dev)
    assert head(f, torch.tensor([1, 2, 3], device=dev)).shape == (3, tiny_target.args.dim)
    # the proposer loads the same files
    prop = FeatureHeadProposer.from_pretrained(out, tiny_target)
    assert prop.name == "eagle"
    # the same data trains a head on the last layer alone
    last = tmp_path / "last"
    assert main(["--tiny", "--stage", "train", "--feature-layers", "none", "--out", str(last),
                 "--data-dir", str(tmp_path / "data"), "--quiet"]) == 0
    assert DraftHead.load(last, tiny_target).fuse is None
    tiny_target.feature_layers = ()  # as the fixture was


def test_written_prompts_keep_each_turn_once_and_none_near_a_benchmark_prompt():
    from specdec.data.prompts import benchmark_prompts, written_prompts

    bench = next(m["content"] for p in benchmark_prompts() for m in p["messages"] if m["role"] == "user")
    turns = ["How do tides work?", "  how do TIDES work ", "Hi", f"Please: {bench}", "Name three rivers in Africa."]
    kept = [p["messages"][0]["content"] for p in written_prompts(turns)]
    assert kept == ["How do tides work?", "Name three rivers in Africa."]


def test_a_kept_vocabulary_scores_its_tokens_as_before(tmp_path, tiny_target):
    """keep_vocab drops LM-head rows, not what the kept ones score; saved and loaded, it stays."""
    head = _random_head(tiny_target)
    dev = tiny_target.embed.weight.device
    f = head(torch.randn(4, tiny_target.args.dim, device=dev), torch.tensor([5, 6, 7, 8], device=dev))
    full = head.draft_logits(f)
    keep = torch.arange(0, len(head.vocab_ids), 3, device=dev)
    head.keep_vocab(head.vocab_ids[keep])
    assert head.cfg.draft_vocab_size == len(keep)
    torch.testing.assert_close(head.draft_logits(f), full[:, keep])
    head.save(tmp_path)
    assert torch.equal(DraftHead.load(tmp_path, tiny_target).vocab_ids, head.vocab_ids)
    with pytest.raises(ValueError, match="within the head's vocabulary"):
        head.keep_vocab(torch.tensor([tiny_target.args.vocab_size - 1, 0], device=dev))


def test_save_load_roundtrip(tmp_path, tiny_target):
    head = _random_head(tiny_target)
    head.save(tmp_path)
    back = DraftHead.load(tmp_path, tiny_target)
    assert torch.equal(back.vocab_ids, head.vocab_ids)
    dev = tiny_target.embed.weight.device
    f, x = torch.randn(4, tiny_target.args.dim, device=dev), torch.tensor([5, 6, 7, 8], device=dev)
    torch.testing.assert_close(back(f, x), head(f, x), atol=2e-2, rtol=2e-2)  # fp16 storage
    # a head on the last layer alone reads the last part of a verifier row that carries more layers
    assert torch.equal(head(torch.cat([torch.randn_like(f), f], -1), x), head(f, x))


def test_feature_is_what_predicted_the_last_token(tiny_target, tiny_tok):
    """The convention the head is trained on: after a round, seq.feature is the pre-norm hidden
    state at position len(tokens) - 2, the one whose logits chose tokens[-1]."""
    from specdec.models.runner import ModelRunner

    eng = make_engine(tiny_target, k=4, tok=tiny_tok, proposer=FeatureHeadProposer(_random_head(tiny_target)))
    seq = eng.add_request(ragged_prompts(1)[0], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        eng.step()
    runner = ModelRunner(tiny_target, 1, 512)
    toks = seq.tokens
    runner.sync(["x"], [toks[:-1] + [0]], [0])
    hidden, _ = runner.forward(["x"], [toks[:-1]])
    torch.testing.assert_close(seq.feature, hidden[0, -1].float().cpu(), atol=1e-4, rtol=1e-4)
    assert int(tiny_target.logits(hidden[0, -1]).argmax()) == toks[-1]


@pytest.mark.parametrize("feature_layers", [(), (0,)])
def test_greedy_is_lossless(tiny_target, tiny_tok, feature_layers):
    prompts = ragged_prompts(6)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = make_engine(tiny_target, k=0, tok=tiny_tok).generate(prompts, params, num_speculative_tokens=0)
    head = _random_head(tiny_target, feature_layers=feature_layers)
    eng = make_engine(tiny_target, k=4, tok=tiny_tok, proposer=FeatureHeadProposer(head))
    seq = eng.add_request(prompts[0], params)
    eng.step()
    eng.step()
    assert seq.feature.shape == ((len(feature_layers) + 1) * tiny_target.args.dim,)  # the layers the head reads
    spec = eng.generate(prompts, params)
    tiny_target.feature_layers = ()  # as the fixture was
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert sum(c.metrics.num_drafted for c in spec) > 0


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_feature_layers_lead_the_hidden_rows_and_change_nothing_else(dtype):
    """A head reading layer 0 too gets [layer 0 ; last layer] per row; the last layer's part and
    the logits are bitwise what the verifier computes without it (in int4, compiled, as served)."""
    from specdec.models import quant
    from specdec.models.runner import ModelRunner
    from specdec.models.tiny import build_tiny, tiny_args

    model = build_tiny(tiny_args(vocab_size=320), seed=0)
    if dtype == "int4":
        model = model.to(quant.ACT_DTYPE)
        quant.quantize_model(model)
    prompts = ragged_prompts(3)

    def hidden(layers):
        model.feature_layers = layers
        runner = ModelRunner(model, 4, 256)
        ids = [f"s{i}" for i in range(len(prompts))]
        runner.sync(ids, prompts, [0] * len(ids))
        h, valid = runner.forward(ids, prompts)
        return h[valid]

    plain, fused = hidden(()), hidden((0,))
    d = model.args.dim
    assert fused.shape == (plain.shape[0], 2 * d)
    assert torch.equal(fused[:, d:], plain)
    assert torch.equal(model.logits(fused), model.logits(plain))
    assert not torch.equal(fused[:, :d], plain)  # layer 0's own output


def test_compiled_step_drafts_what_the_eager_step_drafts():
    """On an int4 verifier the head's step runs compiled, as served: a batch of greedy and sampled
    chains (and trees) gets the eager step's drafts, confidences and q rows."""
    from specdec.models import quant
    from specdec.models.tiny import build_tiny, tiny_args
    from specdec.protocol import ProposeRequest

    model = build_tiny(tiny_args(vocab_size=320), seed=0).to(quant.ACT_DTYPE)  # widths the kernels take
    quant.quantize_model(model, compiled=False)
    head = _random_head(model, vocab=128, feature_layers=(0,))
    assert head.head_q8 is not None
    g = torch.Generator().manual_seed(0)
    reqs = [ProposeRequest(f"s{i}", [5, 9, 11 + i], k, p, torch.randn(2 * model.args.dim, generator=g))
            for i, (k, p) in enumerate([(3, SamplingParams()), (1, SamplingParams()),
                                        (4, SamplingParams(temperature=0.8, seed=7))])]
    for width in (1, 2):
        eager = FeatureHeadProposer(head, width).propose(reqs)
        for batch in (reqs, reqs[:1]):
            compiled = FeatureHeadProposer(head, width, compiled=True).propose(batch)
            for e, c in zip(eager, compiled):
                assert (c.token_ids, c.parents) == (e.token_ids, e.parents)
                torch.testing.assert_close(c.scores, e.scores, atol=1e-3, rtol=3e-2)  # bfloat16 between ops
                if e.probs is not None:
                    torch.testing.assert_close(c.probs, e.probs, atol=1e-3, rtol=3e-2)


def test_sampled_requests_draft_the_heads_argmax(tiny_target, tiny_tok):
    """Sampled requests get the head's argmax chain with a one-hot q (probs None), the chain a
    greedy request with the same feature gets; the sampled output still follows the verifier's
    distribution (tests/test_sampled_output.py)."""
    head = _random_head(tiny_target)
    prop = FeatureHeadProposer(head)
    seen = []
    orig = prop.propose

    def spy(reqs):
        out = orig(reqs)
        seen.extend(zip(reqs, out))
        return out

    prop.propose = spy
    eng = make_engine(tiny_target, k=3, tok=tiny_tok, proposer=prop)
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True)]  # a greedy request in the same batch
    outs = eng.generate(ragged_prompts(4), params)
    assert all(len(c.token_ids) == 24 for c in outs)
    n_sampled = 0
    for req, p in seen:
        if not p.token_ids:
            assert req.feature is None or req.num_speculative_tokens == 0
            continue
        assert len(p.token_ids) == req.num_speculative_tokens and p.probs is None
        if req.params.greedy:
            continue
        n_sampled += 1
        as_greedy = dataclasses.replace(req, params=SamplingParams(max_tokens=24))
        assert orig([as_greedy])[0].token_ids == p.token_ids
    assert n_sampled > 0


def test_sampled_drafts_are_reproducible(tiny_target, tiny_tok):
    prompts = ragged_prompts(3)
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True)
    runs = [make_engine(tiny_target, k=3, tok=tiny_tok, proposer=FeatureHeadProposer(_random_head(tiny_target)))
            .generate(prompts, params) for _ in range(2)]
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]


@pytest.mark.parametrize("width", [1, 2])
def test_drafts_past_the_first_need_a_path_that_sure(tiny_target, width):
    """With min_confidence a chain or tree goes past its first draft only along paths the head
    gives at least that probability (adaptive K's rounds ask for it); without, it is K deep."""
    from specdec.protocol import ProposeRequest

    head = _random_head(tiny_target)
    prop = FeatureHeadProposer(head, width)
    step = prop._step
    sharpness = {"x": 1.0}

    def sharpened(feat, tok):  # a head as sure as we like: its logits scaled
        feat, logits, _, _ = step(feat, tok)
        p = torch.softmax(logits * sharpness["x"], dim=-1)
        p_tok, i = p.max(dim=-1)
        return feat, logits * sharpness["x"], head.vocab_ids[i], p_tok

    prop._step = sharpened
    g = torch.Generator().manual_seed(0)
    feats = [torch.randn(tiny_target.args.dim, generator=g) for _ in range(3)]

    def drafts(floor):
        return prop.propose([ProposeRequest(f"s{i}", [5, 7 + i], 4, SamplingParams(), f, floor)
                             for i, f in enumerate(feats)])

    for sharp in (1.0, 1e4):  # a random head is unsure of everything; sharpened, sure of its argmax
        sharpness["x"] = sharp
        for full, cut in zip(drafts(0.0), drafts(0.5)):
            assert len(full.token_ids) == (4 if width == 1 else 4 * width)  # K deep, w nodes a level
            kept = range(len(cut.token_ids))
            assert set(zip(cut.token_ids, cut.scores)) <= set(zip(full.token_ids, full.scores))
            parents = cut.parents or list(range(-1, len(cut.token_ids) - 1))
            first = [j for j in kept if parents[j] == -1]
            assert len(first) == width  # the first level always
            assert all(cut.scores[j] >= 0.5 for j in kept if parents[j] != -1)
            assert all(p < j for j, p in enumerate(parents))  # parents first: a well-formed tree
            if sharp == 1.0:
                assert len(cut.token_ids) == width
            else:
                assert max(_depth(parents, j) for j in kept) == 4  # sure all the way down


@pytest.mark.parametrize("p,steps,kept", [(0.6, 1, 1), (0.75, 2, 2), (0.9, 4, 4)])
def test_a_chain_steps_on_only_where_its_next_draft_could_be_kept(tiny_target, p, steps, kept):
    """Past a draft the head takes another step only where its path times NEXT_DRAFT_CONFIDENCE
    (0.7) still reaches the floor (0.5): at 0.6 a second draft would need a surer guess than 0.83
    to be kept, so none is made; at 0.75 the second (0.56) is made and kept, a third would need
    0.89; at 0.9 the path stays sure for all four."""
    from specdec.protocol import ProposeRequest

    head = _random_head(tiny_target)
    prop = FeatureHeadProposer(head)
    step, calls = prop._step, []

    def constant(feat, tok):  # the head's own step, its confidence fixed at p
        calls.append(1)
        feat, logits, best, _ = step(feat, tok)
        return feat, logits, best, torch.full_like(best, p, dtype=torch.float32)

    prop._step = constant
    feat = torch.randn(tiny_target.args.dim, generator=torch.Generator().manual_seed(0))
    [out] = prop.propose([ProposeRequest("s", [5, 7], 4, SamplingParams(), feat, 0.5)])
    assert len(calls) == steps and len(out.token_ids) == kept
    calls.clear()
    [out] = prop.propose([ProposeRequest("s", [5, 7], 4, SamplingParams(), feat, 0.0)])  # no floor: K deep
    assert len(calls) == 4 and len(out.token_ids) == 4


def _depth(parents, j):
    return 1 if parents[j] == -1 else 1 + _depth(parents, parents[j])


def test_adaptive_rounds_ask_for_sure_paths_in_process_and_in_the_verifiers_calls(tiny_target, tiny_tok):
    """Adaptive K's rounds send the head MIN_PATH_CONFIDENCE (a fixed K none), and the verifier
    passes a self-drafting request's floor on to its own head."""
    from specdec.config import EngineConfig
    from specdec.confidence import MIN_PATH_CONFIDENCE
    from specdec.engine import SpecEngine
    from specdec.models.runner import ModelRunner
    from specdec.protocol import VerifyRequest
    from specdec.verifier import Verifier

    seen = []

    class Spy(FeatureHeadProposer):
        def propose(self, requests):
            seen.extend(r.min_confidence for r in requests if r.num_speculative_tokens)
            return super().propose(requests)

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    make_engine(tiny_target, k=3, tok=tiny_tok, proposer=Spy(_random_head(tiny_target))).generate(ragged_prompts(2), params)
    assert seen and set(seen) == {0.0}
    seen.clear()
    cfg = EngineConfig(num_speculative_tokens=3, adaptive=True)
    eng = SpecEngine(Verifier(ModelRunner(tiny_target, 4, 512)), Spy(_random_head(tiny_target)), tiny_tok, cfg)
    eng.generate(ragged_prompts(2), params)
    assert seen and set(seen) == {MIN_PATH_CONFIDENCE}
    seen.clear()
    verifier = Verifier(ModelRunner(tiny_target, 4, 512), drafter=Spy(_random_head(tiny_target)))
    req = VerifyRequest("s", [1, 2, 3], [], None, SamplingParams(), self_draft=2,
                        feature=torch.randn(tiny_target.args.dim), draft_min_confidence=0.5)
    verifier._own_drafts([req], [0.0])
    assert seen == [0.5]
