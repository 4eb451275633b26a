"""Every model family against transformers on tiny random checkpoints built here (no download):
logits at every position in one fp32 pass, and greedy tokens equal to HF `generate` at K=0 and with
K=4 drafts from a noisy copy, alone and in a ragged batch. Each checkpoint goes through the real
path: save_pretrained to a directory, `load_model` on it. Sliding-window families see prompts
longer than their window; the RoPE-scaling ones positions past their original context."""
import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import SpecEngine
from specdec.models.runner import ModelRunner
from specdec.models.tiny import noisy_copy
from specdec.proposers import DraftModelProposer
from specdec.sampling import SamplingParams
from specdec.verifier import Verifier

N_NEW = 40
WINDOW = 8
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _cfg(kind: str):
    """A transformers config per family (and per Llama RoPE-scaling type)."""
    import transformers as T

    llama = lambda rope, **kw: T.LlamaConfig(**{**BASE, **kw}, rope_parameters=rope)  # noqa: E731
    gemma = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW, tie_word_embeddings=True)
    return {
        "llama": lambda: llama({"rope_type": "default", "rope_theta": 10000.0}, attention_bias=True, mlp_bias=True),
        "llama3": lambda: llama(LLAMA3),
        "linear": lambda: llama({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, max_position_embeddings=32),
        "dynamic": lambda: llama({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, max_position_embeddings=48),
        "yarn": lambda: llama({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 32}, max_position_embeddings=32),
        "mistral": lambda: T.MistralConfig(**BASE, sliding_window=WINDOW),
        "qwen2": lambda: T.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "qwen3": lambda: T.Qwen3Config(**BASE, head_dim=32),
        "gemma2": lambda: T.Gemma2Config(**{**BASE, **gemma}, attn_logit_softcapping=5.0, final_logit_softcapping=10.0),
        "gemma3": lambda: T.Gemma3TextConfig(**{**BASE, **gemma}, layer_types=["sliding_attention", "full_attention"],
                                             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                              "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                                 "rope_theta": 1e6}}),
        "phi3": lambda: T.Phi3Config(**BASE, sliding_window=WINDOW),
    }[kind]()


FAMILIES = ["llama", "llama3", "linear", "dynamic", "yarn", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]


# Gemma's norms scale by (1 + w): its final norm and post-norms made to, in place of the peaked
# logits and the dominant residual updates an untied LM head and unscaled embeddings give the others
GEMMA_NORMS = {"norm": 6.0, "post_attention_layernorm": 6.0, "post_feedforward_layernorm": 6.0}


@torch.no_grad()
def _randomize(hf, seed: int = 0):
    """Unit-scale activations and peaked logits (no near-ties for greedy); norms, biases and
    every other weight away from their init so a weight read into the wrong place shows."""
    g = torch.Generator().manual_seed(seed)
    gemma = "gemma" in hf.config.model_type
    for name, p in hf.named_parameters():
        r = torch.randn(p.shape, generator=g)
        if "norm" in name:
            p.copy_(0.2 * r + (GEMMA_NORMS.get(name.split(".")[-2], 0.0) if gemma else 1.0))
        elif name.endswith("bias"):
            p.copy_(0.2 * r)
        elif "embed" in name:  # Gemma's scaled (and tied) embedding would otherwise drown the blocks' output
            p.copy_(r * (0.02 if gemma else 1.0))
        else:
            p.copy_(r / p.shape[-1] ** 0.5 * (4.0 if "lm_head" in name else 1.0))
    return hf.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(HF model, ours loaded from its saved directory) for one family."""
    from transformers import AutoModelForCausalLM

    from specdec.models.loader import load_model

    torch.manual_seed(0)
    hf = _randomize(AutoModelForCausalLM.from_config(_cfg(request.param)))
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    return request.param, hf, load_model(str(d), progress=False)


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (20, 33, 47)]


def _hf_greedy(hf, prompt):
    hf.generation_config.eos_token_id = None  # our engine decodes with ignore_eos
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False, output_scores=True,
                      return_dict_in_generate=True)
    top2 = torch.stack([s[0].topk(2).values for s in out.scores])
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4, "a near-tie: the comparison would be fragile"
    return out.sequences[0, len(prompt):].tolist()


def _engine(model, k: int, draft=None) -> SpecEngine:
    """K drafts every round: no adaptive K, no prompt lookup."""
    cfg = EngineConfig(num_speculative_tokens=k, adaptive=False, lookup_min_n=0, max_batch_size=8)
    prop = DraftModelProposer(ModelRunner(draft, 4, 512)) if draft is not None else None
    return SpecEngine(Verifier(ModelRunner(model, 4, 512)), prop, None, cfg)


def test_logits_at_every_position_equal_transformers(pair):
    _, hf, ours = pair
    ids = _prompts()[2] + _prompts()[0]  # 67 tokens: past every window and original context here
    if pair[0] == "dynamic":
        ids = ids[:48]  # HF stretches a whole pass by its length; per position only up to the original
    runner = ModelRunner(ours, 1, 512)
    runner.sync(["s"], [ids + [0]], [0])
    hidden, _ = runner.forward(["s"], [ids])
    want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours.logits(hidden[0]).cpu(), want, atol=2e-4, rtol=1e-4)


def test_greedy_equals_transformers_generate_plain_and_speculative(pair):
    name, hf, ours = pair
    prompts = _prompts()
    want = [_hf_greedy(hf, p) for p in prompts]
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    draft = noisy_copy(ours, 0.3)
    for k, d in ((0, None), (4, draft)):
        assert _engine(ours, k, d).generate(prompts[:1], params)[0].token_ids == want[0], f"{name} K={k} alone"
        outs = _engine(ours, k, d).generate(prompts, params)
        assert [o.token_ids for o in outs] == want, f"{name} K={k} ragged"
        if k:
            m = [o.metrics for o in outs]
            assert 0 < sum(x.num_accepted for x in m) < sum(x.num_drafted for x in m)  # both paths ran


def test_int4_token_pass_speculative_greedy_equals_its_plain_greedy(pair):
    """Each family's own parts (sliding windows, soft-capping, local rotary bases, q/k norms, post
    norms) through the int4 token pass: speculative greedy equals plain greedy in that precision,
    alone and in a ragged batch (passes of every shape must give a token the same hidden state)."""
    import copy

    from specdec.models import quant

    if not quant.available():
        pytest.skip("torch lacks its CPU int4 kernel")
    name, _, ours = pair
    model = copy.deepcopy(ours).to(quant.ACT_DTYPE)
    quant.quantize_model(model, compiled=False)  # compiled invariance: tests/test_quant.py
    draft = noisy_copy(ours, 0.3).to(quant.ACT_DTYPE)
    prompts, params = _prompts(), SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    plain = [o.token_ids for o in _engine(model, 0).generate(prompts, params)]
    assert _engine(model, 4, draft).generate(prompts[:1], params)[0].token_ids == plain[0], f"{name} alone"
    assert [o.token_ids for o in _engine(model, 4, draft).generate(prompts, params)] == plain, f"{name} ragged"


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},  # Llama 3.1
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5/3
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
])
def test_rope_tables_equal_transformers_at_real_scale(rope):
    """Real models' head size, bases and contexts, at positions up to far past the original one."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specdec.models.args import ModelArgs
    from specdec.models.rope import rope_table

    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072, rope_parameters=dict(rope))
    a = ModelArgs.from_hf(cfg)
    pos = torch.tensor([0, 1, 100, 4095, 8191, 8192, 20000, 40000])
    cos, sin = rope_table(a.rope_params(), a.head_dim, int(pos.max()) + 1)
    want_cos, want_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos.unsqueeze(0))
    # HF computes the angles in fp32: at position 40000 they are off by up to ~4e-3 rad; ours are float64
    torch.testing.assert_close(cos[pos].float(), want_cos[0], atol=5e-3, rtol=0)
    torch.testing.assert_close(sin[pos].float(), want_sin[0], atol=5e-3, rtol=0)
