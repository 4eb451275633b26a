"""An EAGLE-style draft head: predicts the verifier's next feature from its current one.

The verifier's feature f_t is its last layer's hidden state *before* the final norm at the
position that produced token x_{t+1}. The head maps (f_t, x_{t+1}) to f^_{t+1}; draft logits are
the verifier's own frozen final norm + LM head applied to f^_{t+1}, restricted to a reduced draft
vocabulary (the tokens the verifier emits most often). Chaining (f^_{t+1}, x_{t+2}) -> f^_{t+2}
drafts K tokens without a KV cache: the head is stateless, all context is in f_t.

    f  = W_fuse [rmsnorm(f_low) ; rmsnorm(f_mid) ; rmsnorm(f_t)]   (first step, when the head reads
                                                    feature layers: EAGLE-3's fused features)
    h  = W_in [rmsnorm(f) ; rmsnorm(embed(x))] + b      (2*dim -> dim)
    h += W2 silu(W1 rmsnorm(h)) * (W3 rmsnorm(h))       (n_blocks residual SwiGLU blocks)
    f^ = h;  logits = head_rows @ rmsnorm_verifier(f^)  ([draft_vocab_size])

Only the trained part and the draft-vocab id list are stored; the embedding, final norm and
LM-head rows are taken from the verifier's `Transformer` at load time (frozen buffers).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.models.llama import Linear, RMSNorm, Transformer

WEIGHTS = "draft_head.safetensors"
CONFIG = "config.json"


@dataclass
class DraftHeadConfig:
    dim: int = 576  # verifier hidden size = feature width
    hidden_size: int = 1536  # SwiGLU width inside each residual block
    n_blocks: int = 2  # residual MLP blocks after the input projection
    draft_vocab_size: int = 8192  # tokens the head can propose (the verifier's most frequent outputs)
    vocab_size: int = 49152  # the verifier's full vocabulary (q is scattered into it)
    norm_eps: float = 1e-5  # RMSNorm epsilon of the head's own norms
    feature_layers: list[int] = field(default_factory=list)  # verifier layers whose outputs the first step also reads
    verifier: str = ""  # what the head was trained against (informational)
    train_info: dict | None = None  # data / training summary written by train_draft (informational)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftHeadConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class SwiGLUBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(self.norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class FeatureFuse(nn.Module):
    """The verifier's feature layers and last layer, each normed (their scales differ by layer),
    projected to one feature: what the head's first step starts from."""

    def __init__(self, parts: int, dim: int, eps: float):
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(dim, eps) for _ in range(parts))
        self.proj = nn.Linear(parts * dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        parts = x.chunk(len(self.norms), dim=-1)
        return self.proj(torch.cat([n(p) for n, p in zip(self.norms, parts)], dim=-1))


class DraftHead(nn.Module):
    def __init__(self, cfg: DraftHeadConfig, vocab_ids: Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.feat_norm = RMSNorm(d, cfg.norm_eps)
        self.tok_norm = RMSNorm(d, cfg.norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.fuse = FeatureFuse(len(cfg.feature_layers) + 1, d, cfg.norm_eps) if cfg.feature_layers else None
        self.blocks = nn.ModuleList(SwiGLUBlock(d, cfg.hidden_size, cfg.norm_eps) for _ in range(cfg.n_blocks))
        if vocab_ids is None:
            vocab_ids = torch.arange(cfg.draft_vocab_size)
        assert len(vocab_ids) == cfg.draft_vocab_size, "draft vocab list does not match the config"
        self.register_buffer("vocab_ids", vocab_ids.long().clone(), persistent=True)  # [Vd] verifier token ids
        # frozen verifier parts, set by attach(); not saved
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)  # [V, dim]
        self.register_buffer("norm_weight", torch.empty(0), persistent=False)  # [dim]
        self.register_buffer("head_weight", torch.empty(0), persistent=False)  # [Vd, dim]
        self.verifier_eps = 1e-5
        self.head_q8: Linear | None = None  # the draft-vocab LM head rows in 8 bits (quantize_int8)

    # -- verifier parts ------------------------------------------------------------------------
    @torch.no_grad()
    def attach(self, verifier: Transformer) -> "DraftHead":
        """Take the embedding, final norm and draft-vocab LM-head rows from the verifier, and move
        the head to the verifier's device and dtype."""
        a = verifier.args
        if a.dim != self.cfg.dim or a.vocab_size != self.cfg.vocab_size:
            raise ValueError(f"draft head was built for dim={self.cfg.dim}, vocab={self.cfg.vocab_size}; "
                             f"the verifier has dim={a.dim}, vocab={a.vocab_size}")
        if any(not 0 <= i < a.n_layers - 1 for i in self.cfg.feature_layers):
            raise ValueError(f"draft head reads layers {self.cfg.feature_layers}; the verifier has {a.n_layers}")
        verifier.feature_layers = tuple(self.cfg.feature_layers)  # its passes now return them too
        w = verifier.embed.weight
        self.to(device=w.device, dtype=w.dtype)
        self.vocab_ids = self.vocab_ids.to(w.device)
        self.embed_weight = verifier.embed.weight.detach()  # shared with the verifier, no copy
        self.norm_weight = verifier.norm.weight.detach()
        self.head_weight = verifier.lm_head.weight.detach()[self.vocab_ids].contiguous()
        self.verifier_eps = a.norm_eps
        if getattr(verifier.lm_head, "_wq", None) is not None:  # an int4 verifier on specdec's kernels
            self.quantize_int8()
        return self

    @torch.no_grad()
    def quantize_int8(self) -> None:
        """Multiply in 8 bits per group of 32 (models.kernels), as the verifier's LM head does: a
        drafting step reads the head's ~9 M weights once per token, and in bfloat16 that step cost
        a fifth of a verifier pass here, more than the drafts it made saved."""
        self.fc = _int8(self.fc)
        if self.fuse is not None:
            self.fuse.proj = _int8(self.fuse.proj)
        for blk in self.blocks:
            blk.w13, blk.w2 = _int8(blk.w13), _int8(blk.w2)
        self.head_q8 = _int8(None, self.head_weight)

    @torch.no_grad()
    def keep_vocab(self, ids: Tensor) -> None:
        """Draft from `ids` only, sorted ids within the head's vocabulary: fewer LM-head rows for
        each drafting step to read. The trained part does not depend on the vocabulary."""
        ids = ids.to(self.vocab_ids.device)
        pos = torch.searchsorted(self.vocab_ids, ids).clamp_max(len(self.vocab_ids) - 1)
        if not torch.equal(self.vocab_ids[pos], ids):
            raise ValueError("keep_vocab: ids must be sorted and within the head's vocabulary")
        self.vocab_ids, self.cfg.draft_vocab_size = ids.clone(), len(ids)
        if self.head_weight.numel():  # attached: its LM-head rows follow
            self.head_weight = self.head_weight[pos].contiguous()
            if self.head_q8 is not None:
                self.head_q8 = _int8(None, self.head_weight)

    # -- compute -------------------------------------------------------------------------------
    def forward(self, feature: Tensor, token: Tensor) -> Tensor:
        """feature [..., dim] (pre-norm verifier feature or a previous prediction; the verifier's
        fused features [..., parts * dim] at a first step), token [...] -> predicted next feature
        [..., dim]."""
        if feature.shape[-1] != self.cfg.dim:  # the last layer's part is the feature a head without fuse reads
            feature = self.fuse(feature) if self.fuse is not None else feature[..., -self.cfg.dim :]
        e = F.embedding(token, self.embed_weight)
        h = self.fc(torch.cat([self.feat_norm(feature), self.tok_norm(e)], dim=-1))
        for blk in self.blocks:
            h = blk(h)
        return h

    def draft_logits(self, feature: Tensor) -> Tensor:
        """Verifier final norm + LM head over the draft vocab: [..., dim] -> [..., Vd]."""
        x = F.rms_norm(feature, (feature.shape[-1],), self.norm_weight, self.verifier_eps)
        return F.linear(x, self.head_weight) if self.head_q8 is None else self.head_q8(x)

    def step(self, feature: Tensor, token: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One drafting step for B rows: the predicted feature [B, dim], its draft-vocab logits
        [B, Vd] (float32), the head's likeliest token [B] (verifier ids) and its probability [B]."""
        f = self(feature, token)
        logits = self.draft_logits(f).float()
        best = logits.argmax(dim=-1)
        p = torch.softmax(logits, dim=-1).gather(1, best[:, None])[:, 0]
        return f, logits, self.vocab_ids[best], p

    def num_trained_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- files ---------------------------------------------------------------------------------
    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.float16) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.named_parameters()}
        sd["vocab_ids"] = self.vocab_ids.detach().to("cpu", torch.int64).contiguous()
        save_file(sd, str(out / WEIGHTS))
        (out / CONFIG).write_text(json.dumps(asdict(self.cfg), indent=2) + "\n")
        return out

    @staticmethod
    def feature_layers_of(head_dir: str | Path) -> tuple[int, ...]:
        """The verifier layers a saved head reads (a Verifier replica sets them without the head)."""
        return tuple(json.loads((Path(head_dir) / CONFIG).read_text()).get("feature_layers", []))

    @classmethod
    def load(cls, head_dir: str | Path, verifier: Transformer) -> "DraftHead":
        from safetensors.torch import load_file

        d = Path(head_dir)
        cfg = DraftHeadConfig.from_dict(json.loads((d / CONFIG).read_text()))
        sd = load_file(str(d / WEIGHTS))
        head = cls(cfg, sd.pop("vocab_ids"))
        missing, unexpected = head.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
        missing = [m for m in missing if m != "vocab_ids"]
        if missing or unexpected:
            raise ValueError(f"draft head weights do not match the config: missing {missing}, unexpected {unexpected}")
        return head.attach(verifier).eval().requires_grad_(False)


def _int8(lin: nn.Linear | None, weight: Tensor | None = None) -> Linear:
    """A linear layer (or a bare weight [out, in]) as specdec's Linear multiplying in 8 bits."""
    w = lin.weight if lin is not None else weight
    out = Linear(w.shape[1], w.shape[0], bias=lin is not None and lin.bias is not None).to(w.dtype)
    out.weight_t.copy_(w.t())
    if out.bias is not None:
        out.bias.copy_(lin.bias)
    out.quantize_int8()
    return out
