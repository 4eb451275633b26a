"""EAGLE-style proposer: a small head chains the verifier's own features K steps ahead.

Each round the verifier hands back the feature f_t that produced the sequence's last token
x_{t+1} (`ProposeRequest.feature`). The head maps (f_t, x_{t+1}) -> f^_{t+1}, drafts x_{t+2} from
the verifier's LM head (restricted to the draft vocabulary) over f^_{t+1}, then continues from
(f^_{t+1}, x_{t+2}). Stateless: no cache, nothing to free. A sequence without a feature yet (its
first round) gets no drafts."""
from __future__ import annotations

from pathlib import Path

import torch

from specdec.models.draft_head import DraftHead
from specdec.models.llama import Transformer
from specdec.protocol import Proposal, ProposeRequest
from specdec.sampling import draw, logits_to_probs, round_generator

SHIPPED_HEAD_DIR = Path(__file__).resolve().parent.parent / "weights" / "draft_head"


def shipped_head_dir() -> Path:
    """The head trained for the default verifier (SmolLM2-135M-Instruct), shipped in the package."""
    return SHIPPED_HEAD_DIR


class FeatureHeadProposer:
    name = "eagle"

    def __init__(self, head: DraftHead):
        self.head = head.eval().requires_grad_(False)

    @classmethod
    def from_pretrained(cls, head_dir: str | Path | None, verifier_model: Transformer) -> "FeatureHeadProposer":
        """Load a head saved by `DraftHead.save` (None = the shipped one) onto `verifier_model`."""
        return cls(DraftHead.load(head_dir or shipped_head_dir(), verifier_model))

    def free(self, seq_id: str) -> None:
        pass

    @torch.no_grad()
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        out = [Proposal([], None) for _ in requests]
        live = [i for i, r in enumerate(requests) if r.num_speculative_tokens > 0 and r.feature is not None]
        if not live:
            return out
        head = self.head
        dev, dt = head.head_weight.device, head.head_weight.dtype
        V = head.cfg.vocab_size
        vocab_ids = head.vocab_ids
        feat = torch.stack([requests[i].feature.reshape(-1) for i in live]).to(dev, dt)  # [B, dim]
        tok = torch.tensor([requests[i].tokens[-1] for i in live], dtype=torch.long, device=dev)  # [B]
        ks = [requests[i].num_speculative_tokens for i in live]
        params = [requests[i].params for i in live]
        gens = [None if p.greedy else round_generator(p.seed, len(requests[i].tokens), "draft", dev)
                for i, p in zip(live, params)]
        probs: dict[int, list] = {i: [] for i, p in zip(live, params) if not p.greedy}
        for step in range(max(ks)):
            feat = head(feat, tok)  # [B, dim] predicted next feature
            logits = head.draft_logits(feat).float()  # [B, Vd]
            nxt = vocab_ids[logits.argmax(dim=-1)]  # greedy choice, full-vocab ids
            for row, i in enumerate(live):
                if step >= ks[row] or params[row].greedy:
                    continue
                full = logits.new_full((1, V), float("-inf"))
                full[0, vocab_ids] = logits[row]
                q = logits_to_probs(full, params[row])[0]  # [V], zero outside the draft vocab
                nxt[row] = draw(q, gens[row])[0]
                probs[i].append(q)
            for row, i in enumerate(live):
                if step < ks[row]:
                    out[i].token_ids.append(int(nxt[row]))
            tok = nxt
        for i, plist in probs.items():
            out[i].probs = torch.stack(plist)  # [K, V]
        return out
