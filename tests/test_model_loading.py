"""What load time refuses, clearly and before decoding: architectures we have no forward for,
options of supported ones we do not compute, model ids with no hub to fetch them from, and draft
models that do not share the verifier's tokenizer. And what it adapts: a draft with a narrower LM
head than its verifier's (the same tokenizer) drafts over the verifier's vocabulary."""
import json

import pytest
import torch

from specdec.config import EngineConfig
from specdec.models.args import UnsupportedModelError
from specdec.models.loader import ModelNotFoundError, load_model
from specdec.models.pairing import IncompatiblePairError
from specdec.sampling import SamplingParams

LLAMA = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


def test_unsupported_model_types_are_refused_naming_them_and_what_is_supported(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "config.json").write_text(json.dumps({"model_type": "my_own_arch"}))
    for name, model_type in (("gpt2", "'gpt2'"), ("custom", "'my_own_arch'")):
        with pytest.raises(UnsupportedModelError) as e:
            load_model(str(tmp_path / name), progress=False)
        msg = str(e.value)
        assert model_type in msg and all(t in msg for t in ("llama", "qwen3", "gemma3_text", "mistral"))


def test_unsupported_options_of_a_supported_family_are_refused():
    from transformers import LlamaConfig, Phi3Config

    from specdec.models.phi3 import Phi3
    from specdec.models.llama import Transformer

    longrope = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=1024,
                          original_max_position_embeddings=128,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    with pytest.raises(UnsupportedModelError, match="longrope"):
        Phi3.hf_args(longrope)
    partial = LlamaConfig(**LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                    "partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        Transformer.hf_args(partial)


def test_a_model_id_without_a_reachable_hub_is_a_clear_error(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("cannot reach the hub and nothing is cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError, match="no model hub is reachable") as e:
        load_model("meta-llama/Llama-3.2-1B-Instruct", progress=False)
    assert "meta-llama/Llama-3.2-1B-Instruct" in str(e.value)


def test_a_model_id_goes_to_the_hub_and_fails_cleanly_here():
    """The real huggingface_hub: this machine reaches no hub (or the id does not exist)."""
    with pytest.raises(ModelNotFoundError, match="specdec-test/no-such-model"):
        load_model("specdec-test/no-such-model", progress=False)
    with pytest.raises(ModelNotFoundError, match="no model at"):
        load_model("./no/such/dir/", progress=False)


def _byte_tokenizer(reverse: bool = False, extra: tuple[str, ...] = ()):
    """The tiny byte-level tokenizer, or one of its size whose ids differ (reverse), or a longer one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specdec.models.tiny import SPECIALS, tiny_tokenizer

    if not reverse:
        tok = tiny_tokenizer()
        tok.add_tokens(list(extra))
        return tok
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), reverse=True)
    tk = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>")


def _draft_dir(path, tok, vocab_size: int = 259):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**LLAMA, "vocab_size": vocab_size}, initializer_range=0.2)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("tok,why", [(dict(extra=("hello",)), "260 vs 259 tokens"),
                                     (dict(reverse=True), "differently")])
def test_a_draft_with_another_tokenizer_is_refused_at_load(tmp_path, tok, why):
    from specdec.engine import build_proposer

    draft = _draft_dir(tmp_path / "draft", _byte_tokenizer(**tok))
    with pytest.raises(IncompatiblePairError, match=why):
        build_proposer(draft, EngineConfig(verifier="tiny", draft=draft, progress=False))


def test_a_draft_with_a_narrower_lm_head_drafts_over_the_verifiers_vocabulary(tmp_path):
    """Same tokenizer, 259 logits against the verifier's 300: padded with -inf, lossless greedy."""
    from specdec.engine import SpecEngine

    draft = _draft_dir(tmp_path / "draft", _byte_tokenizer())
    cfg = dict(verifier="tiny:vocab_size=300", adaptive=False, lookup_min_n=0, progress=False, max_model_len=256)
    spec = SpecEngine.from_config(EngineConfig(**cfg, draft=draft, num_speculative_tokens=4))
    plain = SpecEngine.from_config(EngineConfig(**cfg, draft="none", num_speculative_tokens=0))
    runner = spec.proposers["draft"].runner
    assert runner.model.logits(torch.zeros(1, 64, device=runner.device)).shape == (1, 300)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[5, 17, 42, 7, 99, 3], [9, 8, 7]]
    got = spec.generate(prompts, params)
    assert [g.token_ids for g in got] == [p.token_ids for p in plain.generate(prompts, params)]
    assert sum(g.metrics.num_drafted for g in got) > 0


LLAMA_31_8B = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
               "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
               "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
               "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
LLAMA_32_1B = {**LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
               "tie_word_embeddings": True, "rope_scaling": {**LLAMA_31_8B["rope_scaling"], "factor": 32.0}}


def test_the_gpu_configs_pair_reads_as_llama3_with_its_rope_scaling(tmp_path):
    """cluster/serve_config.gpu.yaml's pair, from their hub config.json files (transformers 4 layout)."""
    import yaml
    from transformers import AutoConfig

    from specdec.models.loader import family_of, read_model_type
    from specdec.models.llama import Transformer

    app = yaml.safe_load(open("cluster/serve_config.gpu.yaml"))["applications"][0]["args"]
    assert "Llama-3.1-8B" in app["verifier"] and "Llama-3.2-1B" in app["draft"]
    args = []
    for name, cfg in (("verifier", LLAMA_31_8B), ("draft", LLAMA_32_1B)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        cls = family_of(read_model_type(tmp_path / name))
        args.append(cls.hf_args(AutoConfig.from_pretrained(tmp_path / name)))
        assert cls is Transformer
    v, d = args
    assert v.rope_scaling["rope_type"] == d.rope_scaling["rope_type"] == "llama3"
    assert (v.rope_scaling["factor"], d.rope_scaling["factor"]) == (8.0, 32.0) and v.rope_theta == 500000.0
    assert v.max_position == d.max_position == 131072 and v.vocab_size == d.vocab_size
    assert (v.head_dim, d.head_dim, d.tie_embeddings) == (128, 64, True)
