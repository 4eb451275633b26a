import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
torch.set_num_threads(2)

# SPECDEC_TEST_DEVICE=cuda runs the engine tests' model compute on that device: every ModelRunner
# moves its model there (tests build their tiny models on the CPU). For a lent GPU; CI leaves it unset.
TEST_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE")
if TEST_DEVICE:
    from specdec.models.runner import ModelRunner

    _runner_init = ModelRunner.__init__

    def _init_on_test_device(self, model, *args, **kwargs):
        _runner_init(self, model.to(TEST_DEVICE), *args, **kwargs)

    ModelRunner.__init__ = _init_on_test_device


@pytest.fixture(scope="session")
def tiny_target():
    from specdec.models.tiny import build_tiny

    return build_tiny(seed=0)


@pytest.fixture(scope="session")
def tiny_tok():
    from specdec.models.tiny import tiny_tokenizer
    from specdec.tokenizer import TextTokenizer

    return TextTokenizer(tiny_tokenizer())


def make_engine(target, draft=None, k=4, tok=None, max_seqs=16, max_len=512, max_batch=16, proposer=None,
                prefix_caching=True):
    from specdec.config import EngineConfig
    from specdec.engine import SpecEngine
    from specdec.models.runner import ModelRunner
    from specdec.proposers import DraftModelProposer
    from specdec.verifier import Verifier

    if proposer is None and draft is not None:
        proposer = DraftModelProposer(ModelRunner(draft, max_seqs, max_len, prefix_caching=prefix_caching))
    cfg = EngineConfig(num_speculative_tokens=k, adaptive=False, max_batch_size=max_batch)
    return SpecEngine(Verifier(ModelRunner(target, max_seqs, max_len, prefix_caching=prefix_caching)), proposer, tok, cfg)


def assert_cache_equals_fresh_recompute(runner, seqs, model) -> list[int]:
    """Each sequence's K/V rows in runner, for the prefix of its tokens the slot holds, equal a
    fresh runner's computing that prefix from scratch. Returns the prefix lengths."""
    from specdec.models.runner import ModelRunner, _common_prefix

    fresh, held = ModelRunner(model, len(seqs) + 1, runner.max_len, prefix_caching=False), []
    for s in seqs:
        slot = runner.slots[s.seq_id]
        n = _common_prefix(slot.tokens, s.tokens)  # what the cache holds of the sequence
        fresh.sync([s.seq_id], [s.tokens[:n] + [0]], [0])
        fresh.forward([s.seq_id], [s.tokens[:n]])
        f = fresh.slots[s.seq_id]
        for (kc, vc), (fk, fv) in zip(runner.caches, fresh.caches):
            torch.testing.assert_close(kc[slot.index, :, :n], fk[f.index, :, :n], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(vc[slot.index, :, :n], fv[f.index, :, :n], atol=1e-5, rtol=1e-4)
        held.append(n)
    return held


def ragged_prompts(n=8, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (3 + 5 * i,), generator=g).tolist() for i in range(n)]


def tiny_head_dir(out):
    """A random draft head for the tiny verifier, saved where a Drafter can load it; it reads the
    verifier's first layer too (fused features), so the Verifier must return that layer's rows."""
    from specdec.models.draft_head import DraftHead, DraftHeadConfig
    from specdec.models.tiny import build_from_spec

    target = build_from_spec("tiny")
    torch.manual_seed(0)
    a = target.args
    cfg = DraftHeadConfig(dim=a.dim, hidden_size=64, n_blocks=1, draft_vocab_size=128, vocab_size=a.vocab_size,
                          feature_layers=[0])
    DraftHead(cfg, torch.arange(128)).attach(target).save(out)
    return out
