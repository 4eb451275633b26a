"""Token trees: verified in one pass, the accepted path kept (its K/V moved to its positions),
greedy output identical to plain decoding in float32 and in int4 (bitwise-invariant tree passes),
the head's trees well formed, and adaptive pruning by calibrated confidence."""
import pytest

from conftest import assert_cache_equals_fresh_recompute, make_engine, ragged_prompts
from specdec.confidence import Confidence, prune
from specdec.models import quant
from specdec.models.tiny import build_tiny, tiny_args
from specdec.protocol import Proposal
from specdec.proposers.feature_head import FeatureHeadProposer
from specdec.sampling import SamplingParams
from specdec.tree_sampler import greedy_path

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


class OracleTrees:
    """Trees that hide the verifier's greedy continuation on a branch that is never the first:
    at each depth a wrong token (with a wrong child), then the right one, then another wrong one.
    Accepted tokens then always come from rows the likeliest path does not take."""

    name = "oracle"

    def __init__(self, continuations: dict[tuple, list[int]], vocab: int):
        self.cont, self.vocab = continuations, vocab

    def free(self, seq_id):
        pass

    def propose(self, requests):
        out = []
        for r in requests:
            prompt = next(p for p in self.cont if tuple(r.tokens[: len(p)]) == p)
            truth = self.cont[prompt][len(r.tokens) - len(prompt):][: r.num_speculative_tokens]
            toks, parents, parent = [], [], -1
            for t in truth:
                wrong = [(t + d) % self.vocab for d in (1, 2, 3)]
                toks += [wrong[0], wrong[2], t, wrong[1]]
                parents += [parent, len(toks) - 4, parent, parent]
                parent = len(toks) - 2
            out.append(Proposal(toks, None, parents))
        return out


@pytest.fixture(scope="module", params=["float32", "int4"])
def target(request):
    if request.param == "float32":
        return build_tiny(seed=0)
    model = build_tiny(tiny_args(vocab_size=320), seed=0).to(quant.ACT_DTYPE)  # widths the kernels take
    quant.quantize_model(model)
    return model


def test_trees_keep_the_verifiers_greedy_output_and_the_right_cache(target):
    prompts = ragged_prompts(5)
    plain = [c.token_ids for c in make_engine(target, k=0).generate(prompts, GREEDY)]
    oracle = OracleTrees({tuple(p): o for p, o in zip(prompts, plain)}, target.args.vocab_size)
    eng = make_engine(target, k=3, proposer=oracle)
    seqs = [eng.add_request(p, GREEDY) for p in prompts]
    for _ in range(3):
        eng.step()
    if target.token_pass is None:  # float32: each kept row equals a fresh computation of the sequence
        held = assert_cache_equals_fresh_recompute(eng.verifier.runner, seqs, target)
        assert all(n >= len(p) + 4 for n, p in zip(held, prompts))  # rows the trees' accepted paths moved
    while any(not s.finished for s in seqs):
        eng.step()
    assert [s.output_ids for s in seqs] == plain
    m = [s.metrics for s in seqs]
    assert sum(x.num_verifier_passes for x in m) < 0.35 * sum(len(o) for o in plain)  # ~4 tokens a pass


def test_the_heads_trees_are_lossless_and_well_formed(target):
    from test_draft_head import _random_head

    prompts = ragged_prompts(4)
    plain = [c.token_ids for c in make_engine(target, k=0).generate(prompts, GREEDY)]
    # a head on fused features (the verifier's first layer too), its matmuls in 8 bits on int4
    prop = FeatureHeadProposer(_random_head(target, vocab=64, feature_layers=(0,)), tree_width=3)
    seen = []
    orig = prop.propose
    prop.propose = lambda reqs: seen.extend(orig(reqs)) or seen[-len(reqs):]
    spec = [c.token_ids for c in make_engine(target, k=4, proposer=prop).generate(prompts, GREEDY)]
    target.feature_layers = ()  # as the fixture was
    assert spec == plain
    for p in (x for x in seen if x.token_ids):
        assert all(q < j for j, q in enumerate(p.parents))  # parents first
        for j, q in enumerate(p.parents):
            sibs = [p.token_ids[i] for i, r in enumerate(p.parents) if r == q]
            assert len(sibs) == len(set(sibs))  # a node's children differ
            if q >= 0:
                assert p.scores[j] <= p.scores[q] + 1e-6  # a path is no likelier than its prefix
        for j in range(1, len(p.parents)):  # depth first: a node follows its parent or a sibling's subtree
            anc, a = set(), j - 1
            while a >= 0:
                anc.add(a)
                a = p.parents[a]
            assert p.parents[j] == -1 or p.parents[j] in anc


def test_greedy_path_follows_the_argmax_through_the_tree():
    drafts, parents = [5, 7, 8, 9], [-1, -1, 1, 1]  # root -> 5, 7; 7 -> 8, 9
    assert greedy_path(drafts, parents, [7, 0, 9, 0, 4]) == ([7, 9, 4], [1, 3])  # row 4: after draft 3
    assert greedy_path(drafts, parents, [6, 0, 0, 0, 0]) == ([6], [])
    assert greedy_path(drafts, parents, [5, 3, 0, 0, 0]) == ([5, 3], [0])


def _proposal(scores, parents=None):
    return Proposal(list(range(10, 10 + len(scores))), None, parents, scores)


def test_prune_keeps_what_pays_and_never_an_orphan():
    conf = Confidence()
    props = [_proposal([0.9, 0.5, 0.2]), _proposal([0.8, 0.7, 0.1], parents=[-1, -1, 1])]
    flat = prune(props, [True, True], conf, lambda n: 1.0, 2)  # extra tokens cost nothing: keep all
    assert [len(p.token_ids) for p in flat] == [3, 3]
    steep = prune(props, [True, True], conf, lambda n: 1.0 + n, 2)  # each costs a whole pass: none
    assert [len(p.token_ids) for p in steep] == [0, 0]
    mid = prune(props, [True, True], conf, lambda n: 1.0 + 0.25 * n, 2)
    assert mid[0].token_ids == [10] and mid[1].token_ids == [10, 11] and mid[1].parents == [-1, -1]  # rate 4.4 / 1.75
    orphan = prune([_proposal([0.9, 0.1, 0.8], parents=[-1, 0, 1])], [True], conf, lambda n: 1.0 + 0.05 * n, 1)
    assert orphan[0].token_ids == [10, 11, 12]  # the grandchild, rated as its parent, comes right after it


def test_confidence_learns_from_what_the_verifier_accepted():
    from specdec.protocol import VerifyResult

    conf = Confidence()
    p = _proposal([0.95, 0.9])
    for _ in range(200):  # confident drafts, always rejected
        conf.observe([p], [VerifyResult([1], 0, 2)], [True])
    assert conf.acceptance(0.95, True) < 0.1 and conf.acceptance(0.95, False) > 0.9


def test_adaptive_trees_stay_lossless(target):
    from test_draft_head import _random_head

    from specdec.config import EngineConfig
    from specdec.engine import SpecEngine
    from specdec.models.runner import ModelRunner
    from specdec.verifier import Verifier

    prompts = ragged_prompts(4)
    plain = [c.token_ids for c in make_engine(target, k=0).generate(prompts, GREEDY)]
    cfg = EngineConfig(num_speculative_tokens=4, adaptive=True, draft_tree_width=2)
    eng = SpecEngine(Verifier(ModelRunner(target, 8, 512)), FeatureHeadProposer(_random_head(target, 64), 2), None, cfg)
    assert [c.token_ids for c in eng.generate(prompts, GREEDY)] == plain


@pytest.mark.parametrize("window", [None, 3])
def test_tree_masks_see_each_nodes_path_as_a_chain_would(window):
    """The padded path's masks: a node sees the rows of the positions a chain of its path sees
    (a sliding window counted in positions, not rows)."""
    from specdec.models.layers import BatchIndex

    tree = [-1, 0, 1, 0, 3, 4]  # inputs: root, a branch of two, another of three
    start, ctx_rows = 6, 12
    b = BatchIndex([0], [start], [len(tree)], 99, "cpu", [tree])
    mask = b.mask_for(window)[0, 0]  # [T, ctx]
    for t in range(len(tree)):
        path, a = [], t
        while a >= 0:
            path.append(a)
            a = tree[a]
        rows_by_pos = list(range(start)) + [start + j for j in reversed(path)]  # position -> row
        p = len(rows_by_pos) - 1
        want = {rows_by_pos[q] for q in range(p + 1) if window is None or q > p - window}
        assert {r for r in range(ctx_rows) if r < mask.shape[-1] and mask[t, r]} == want, t
        assert int(b.rope_pos[0, t]) == p


def test_a_tree_of_its_root_alone_gets_a_sliding_windows_mask():
    """One query whose tree holds no drafts (all pruned): no full mask is needed, yet a sliding
    layer's is, counted back from its position."""
    from specdec.models.layers import BatchIndex

    b = BatchIndex([0], [20], [1], 99, "cpu", [[-1]])
    assert b.mask is None
    assert b.mask_for(4)[0, 0, 0].nonzero().flatten().tolist() == [17, 18, 19, 20]


def test_a_tree_near_the_end_of_the_context_keeps_only_the_nodes_that_fit():
    target = build_tiny(seed=0)
    prompt = ragged_prompts(8)[-1][:30]
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    plain = make_engine(target, k=0, max_len=44).generate([prompt], params)[0].token_ids
    oracle = OracleTrees({tuple(prompt): plain}, target.args.vocab_size)  # 12 nodes a round at K = 3
    out = make_engine(target, k=3, proposer=oracle, max_len=44).generate([prompt], params)[0]
    assert out.token_ids == plain and out.finish_reason == "length"
