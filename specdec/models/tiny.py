"""Tiny random-weight Llama models and a byte-level tokenizer, built in code, for fast tests.

`noisy_copy` makes a draft that agrees with a tiny target to a controlled degree: noise 0 is the
target itself (acceptance 1), larger noise lowers acceptance smoothly."""
from __future__ import annotations

import copy

import torch

from specdec.models.llama import ModelArgs, Transformer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 256 + len(SPECIALS)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_args(**overrides) -> ModelArgs:
    base = dict(vocab_size=TINY_VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                max_position=1024, rope_theta=10000.0, tie_embeddings=False)
    base.update(overrides)
    return ModelArgs(**base)


@torch.no_grad()
def build_tiny(args: ModelArgs | None = None, seed: int = 0) -> Transformer:
    """Random weights with unit-scale activations, so logits are peaked and argmax ties are rare."""
    args = args or tiny_args()
    g = torch.Generator().manual_seed(seed)
    model = Transformer(args)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            continue
        fan_in = p.shape[-1] if p.dim() > 1 else 1
        p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5 * (1.0 if "embed" not in name else fan_in**0.5))
    return model.eval()


@torch.no_grad()
def noisy_copy(model: Transformer, noise: float, seed: int = 1) -> Transformer:
    """The same weights plus Gaussian noise of `noise` times each tensor's std."""
    g = torch.Generator().manual_seed(seed)
    draft = copy.deepcopy(model)
    for p in draft.parameters():
        p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * p.float().std().to(p.dtype) * noise)
    return draft.eval()


def tiny_tokenizer():
    """A byte-level tokenizer (256 byte tokens + ChatML specials) as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                  unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def _spec_opts(spec: str) -> dict[str, str]:
    return dict(kv.split("=") for kv in spec.partition(":")[2].split(",") if kv)


def spec_args(spec: str) -> ModelArgs:
    """The ModelArgs a 'tiny[:opts]' spec builds (its seed and noise options aside)."""
    opts = {k: v for k, v in _spec_opts(spec).items() if k not in ("seed", "noise", "draft_seed")}
    return tiny_args(**{k: int(v) for k, v in opts.items()})


def build_from_spec(spec: str) -> Transformer:
    """'tiny' or 'tiny:seed=0,noise=0.3,n_layers=1'. With noise, a noisy copy of the target that
    the same spec without noise builds (so 'tiny:noise=0.3' is a draft for 'tiny')."""
    opts = _spec_opts(spec)
    seed = int(opts.get("seed", 0))
    noise = float(opts.get("noise", 0.0))
    draft_seed = int(opts.get("draft_seed", 1))
    target = build_tiny(spec_args(spec), seed)
    return noisy_copy(target, noise, draft_seed) if noise > 0 else target
