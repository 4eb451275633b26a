"""ModelArgs: the shape and the per-family switches of a decoder, read from a transformers config.

`ModelArgs.from_hf` reads what every family names alike (sizes, rotary parameters, sliding windows);
each family module overrides the switches that are its own (Qwen2's biases, Gemma's norms, ...)."""
from __future__ import annotations

from dataclasses import dataclass, field

SCALED_ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")  # besides "default"; see rope.py


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture (or one of its options) we have no forward for."""


@dataclass
class ModelArgs:
    vocab_size: int = 49152  # tokens in the embedding / LM head
    dim: int = 576  # hidden size
    n_layers: int = 30  # decoder blocks
    n_heads: int = 9  # query heads
    n_kv_heads: int = 3  # key/value heads (GQA when < n_heads)
    intermediate_size: int = 1536  # MLP width
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    max_position: int = 8192  # longest context served (the scaled one when RoPE scaling extends it)
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    tie_embeddings: bool = True  # LM head shares the embedding matrix
    head_dim: int = 0  # per-head width; 0: dim // n_heads (Qwen3 and Gemma set their own)
    rope_scaling: dict | None = field(default=None)  # HF rope parameters (rope_type, factor, ...) when not default
    local_rope: dict | None = field(default=None)  # sliding layers' own rope parameters (Gemma 3)
    sliding_window: int | None = None  # positions a sliding layer sees (Mistral, Gemma, some Qwen)
    layer_types: tuple[str, ...] = ()  # per layer "full_attention"/"sliding_attention"; (): all sliding if a window is set
    out_bias: bool | None = None  # o_proj bias; None: as attention_bias (Qwen2 has q/k/v biases only)
    mlp_bias: bool = False  # gate/up/down biases (some Llamas)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    act: str = "silu"  # gated MLP activation: "silu" or "gelu_tanh" (Gemma's GeGLU)
    norm_offset: float = 0.0  # norms scale by (offset + w): Gemma's are (1 + w)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(dim))
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)
    final_softcap: float | None = None  # tanh soft-capping of the logits (Gemma 2)

    def __post_init__(self):
        self.head_dim = self.head_dim or self.dim // self.n_heads
        if self.out_bias is None:
            self.out_bias = self.attention_bias
        self.layer_types = tuple(self.layer_types)

    def window(self, layer: int) -> int | None:
        """How many past positions layer `layer` attends to; None: all."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def rope_params(self, kind: str = "global") -> dict:
        """Rotary parameters of the "global" layers or the "local" (sliding) ones."""
        if kind == "local" and self.local_rope is not None:
            return self.local_rope
        return {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}

    def rope_kind(self, layer: int) -> str:
        """"local" for a sliding layer with its own rotary base (Gemma 3), else "global"."""
        local = self.local_rope is not None and self.layer_types and self.layer_types[layer] == "sliding_attention"
        return "local" if local else "global"

    def norm_weight(self, w):
        """An HF norm weight as our RMSNorm's (folds Gemma's 1 + w into the weight)."""
        return w.float() + self.norm_offset if self.norm_offset else w

    @classmethod
    def from_hf(cls, cfg) -> "ModelArgs":
        """From a transformers config of a Llama-like model (the fields every family shares)."""
        rope, local = hf_rope_params(cfg)
        return cls(
            vocab_size=cfg.vocab_size,
            dim=cfg.hidden_size,
            n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            intermediate_size=cfg.intermediate_size,
            rope_theta=float(rope["rope_theta"]),
            norm_eps=cfg.rms_norm_eps,
            max_position=served_context(rope, getattr(cfg, "max_position_embeddings", 8192)),
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            head_dim=getattr(cfg, "head_dim", None) or 0,
            rope_scaling=None if rope["rope_type"] == "default" else rope,
            local_rope=local,
            sliding_window=getattr(cfg, "sliding_window", None),
            layer_types=tuple(getattr(cfg, "layer_types", None) or ()),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        )


def hf_rope_params(cfg) -> tuple[dict, dict | None]:
    """(global, local) rotary parameters of a transformers config, each with rope_type and
    rope_theta; local is None unless sliding layers have their own (Gemma 3). Reads
    transformers 5's `rope_parameters` (flat, or nested by layer type) and 4's `rope_theta` +
    `rope_scaling`. Refuses what rope.py does not compute."""
    rp = getattr(cfg, "rope_parameters", None)
    local = None
    if rp is None:  # transformers 4: top-level thetas (Gemma 3's local one too) and rope_scaling
        rp = dict(getattr(cfg, "rope_scaling", None) or {})
        if getattr(cfg, "rope_local_base_freq", None) is not None:
            local = _rope_entry(cfg, {"rope_theta": cfg.rope_local_base_freq})
    elif "full_attention" in rp or "sliding_attention" in rp:
        local = _rope_entry(cfg, rp.get("sliding_attention") or {})
        rp = rp.get("full_attention") or {}
    rope = _rope_entry(cfg, rp)
    return rope, (local if local is not None and local != rope else None)


def _rope_entry(cfg, rp: dict) -> dict:
    rp = dict(rp)
    rp["rope_type"] = rp.get("rope_type") or rp.get("type") or "default"
    rp.pop("type", None)
    rp.setdefault("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0)
    kind = rp["rope_type"]
    if kind not in ("default",) + SCALED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {kind!r} is not supported; supported: default, "
                                    + ", ".join(SCALED_ROPE_TYPES))
    partial = rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported (RoPE over the whole head only)")
    mpe = getattr(cfg, "max_position_embeddings", 8192)
    if kind == "dynamic":  # HF's dynamic NTK starts stretching past max_position_embeddings itself
        rp["original_max_position_embeddings"] = mpe
    elif kind in ("llama3", "yarn"):
        rp.setdefault("original_max_position_embeddings", getattr(cfg, "original_max_position_embeddings", None) or mpe)
        if kind == "yarn" and not rp.get("factor"):  # as HF: the stretch from the original context to the stated one
            rp["factor"] = mpe / rp["original_max_position_embeddings"]
    return rp


def served_context(rope: dict, max_position_embeddings: int) -> int:
    """How far positions go: a scaling that stretches an original context by `factor` serves
    factor times it (Qwen's yarn and the dynamic/linear configs keep max_position_embeddings at
    the original length); Llama 3.x states the context it supports itself."""
    if rope["rope_type"] in ("default", "llama3") or not rope.get("factor"):
        return max_position_embeddings
    orig = rope.get("original_max_position_embeddings") or max_position_embeddings
    return max(max_position_embeddings, int(rope["factor"] * orig))
