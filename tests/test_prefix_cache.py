"""Prefix caching: a new sequence starts from the longest prefix a slot (freed or live) holds,
which changes the work done and nothing else."""
import torch

from conftest import assert_cache_equals_fresh_recompute, make_engine
from specdec.models.runner import ModelRunner
from specdec.models.tiny import noisy_copy
from specdec.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SYSTEM = list(range(10, 60))  # a 50-token "system prompt" every request starts with


def shared_prompts(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [SYSTEM + torch.randint(3, 256, (4 + 3 * i,), generator=g).tolist() for i in range(n)]


def test_freed_slots_prefix_is_reused_and_output_unchanged(tiny_target):
    prompts = shared_prompts()
    ref = make_engine(tiny_target, k=0, prefix_caching=False).generate(prompts, GREEDY)
    eng = make_engine(tiny_target, noisy_copy(tiny_target, 0.3), k=3)
    got = [eng.generate([p], GREEDY)[0] for p in prompts]  # one after another: each reuses a freed slot
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    runner = eng.verifier.runner
    assert runner.prefix_hits == 3 and runner.prefix_tokens_reused >= 3 * len(SYSTEM)
    assert eng.proposers["draft"].runner.prefix_hits == 3  # the draft model's cache too
    off = make_engine(tiny_target, k=0, prefix_caching=False)
    [off.generate([p], GREEDY) for p in prompts]
    assert off.verifier.runner.prefix_hits == 0


def test_freed_slot_is_taken_over_in_place(tiny_target):
    runner = ModelRunner(tiny_target, 4, 256)
    a, b, c = SYSTEM + [7, 8, 9], SYSTEM + [200, 201], list(range(100, 120))
    runner.catch_up(["a"], [a], [0])
    slot_a = runner.slots["a"].index
    runner.free("a")
    runner.catch_up(["c"], [c], [0])  # shares nothing: must not take a's slot, which holds a prefix
    assert runner.slots["c"].index != slot_a
    runner.catch_up(["b"], [b], [0])
    assert runner.slots["b"].index == slot_a and runner.slots["b"].tokens == b[:-1]
    assert runner.prefix_tokens_reused == len(SYSTEM)


def test_prefix_copied_from_a_live_sequence_equals_fresh_recompute(tiny_target):
    """Users arriving together: the second copies the first's freshly prefilled prefix rows."""
    prompts = shared_prompts(3, seed=2)
    eng = make_engine(tiny_target, k=0)
    seqs = [eng.add_request(p, GREEDY) for p in prompts]
    for _ in range(3):
        eng.step()
    assert eng.verifier.runner.prefix_hits == 2
    assert_cache_equals_fresh_recompute(eng.verifier.runner, seqs, tiny_target)
    while eng.active:
        eng.step()
    ref = make_engine(tiny_target, k=0, prefix_caching=False).generate(prompts, GREEDY)
    assert [s.output_ids for s in seqs] == [c.token_ids for c in ref]


def test_eviction_keeps_the_victims_prefix(tiny_target):
    """With every slot busy, a new sequence evicts the least recently used one and may start
    from the prefix the victim held."""
    runner = ModelRunner(tiny_target, 2, 256)
    runner.catch_up(["a", "b"], [SYSTEM + [1, 2], list(range(100, 110))], [0, 0])
    runner.catch_up(["b"], [list(range(100, 110))], [0])  # a is now least recently used
    runner.catch_up(["c"], [SYSTEM + [3]], [0])
    assert runner.evictions == 1 and "a" not in runner.slots and runner.slots["c"].tokens == SYSTEM
    assert runner.prefix_tokens_reused == len(SYSTEM)
