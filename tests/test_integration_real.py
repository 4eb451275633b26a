"""The real embedded SmolLM2 verifier (fetched and converted on first use): greedy stays exact, in
float32 against transformers, and in every dtype against plain decoding in that dtype."""
import pytest
import torch

from specdec.sampling import SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Summarize: The cat sat on the mat. The mat was red. The cat was happy on the red mat."}],
]


@pytest.fixture(scope="module", params=["float32", "auto"])
def engine(request):
    from specdec.config import EngineConfig
    from specdec.engine import SpecEngine

    return SpecEngine.from_config(EngineConfig(verifier="default", draft="none", num_speculative_tokens=0, max_seqs=4,
                                               max_model_len=1024, dtype=request.param, progress=False))


@pytest.fixture(scope="module")
def plain(engine):
    return engine.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True), num_speculative_tokens=0)


def test_plain_matches_hf_generate(engine, plain):
    from transformers import AutoModelForCausalLM

    from specdec.models.loader import model_dir

    if engine.cfg.dtype != "float32":
        pytest.skip("transformers runs float32: only float32 is held to its tokens")
    hf = AutoModelForCausalLM.from_pretrained(model_dir("default"), dtype=torch.float32).eval()
    for prompt, ours in zip(PROMPTS, plain):
        ids = engine.tokenizer.chat(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        n = len(ref) - (ref[-1] in engine.tokenizer.eos_token_ids)  # HF keeps the EOS it stopped on
        assert ours.token_ids[:n] == ref[:n]


def test_ngram_speculation_is_lossless(engine, plain):
    from specdec.proposers import NgramProposer

    engine.proposers["ngram"] = NgramProposer()
    got = engine.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True), num_speculative_tokens=4,
                          proposer="ngram")
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    assert sum(g.metrics.num_drafted for g in got) > 0


def test_batched_plain_equals_single(engine, plain):
    single = engine.generate(PROMPTS[2:], SamplingParams(max_tokens=32, ignore_eos=True), num_speculative_tokens=0)
    assert single[0].token_ids == plain[2].token_ids
