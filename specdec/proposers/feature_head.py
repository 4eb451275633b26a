"""EAGLE-style proposer: a small head chains the verifier's own features K steps ahead.

Each round the verifier hands back the feature f_t that produced the sequence's last token
x_{t+1} (`ProposeRequest.feature`). The head maps (f_t, x_{t+1}) -> f^_{t+1}, drafts x_{t+2} from
the verifier's LM head (restricted to the draft vocabulary) over f^_{t+1}, then continues from
(f^_{t+1}, x_{t+2}). Stateless: no cache, nothing to free. A sequence without a feature yet (its
first round) gets no drafts.

With a tree width w > 1 it drafts a token tree instead: K deep, the w likeliest paths kept at
each depth (`_trees`). Every draft carries its confidence (the head's probability of its path).
A chain or tree keeps a draft past its first only where that reaches the request's min_confidence,
and steps on only where the next draft could (specdec.confidence); adaptive speculation then
keeps only the drafts worth verifying."""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import Tensor

from specdec.confidence import NEXT_DRAFT_CONFIDENCE
from specdec.models.compiled import CompiledMethod
from specdec.models.draft_head import DraftHead
from specdec.models.llama import Transformer
from specdec.protocol import Proposal, ProposeRequest

SHIPPED_HEAD_DIR = Path(__file__).resolve().parent.parent / "weights" / "draft_head"


def shipped_head_dir() -> Path:
    """The head trained for the default verifier (SmolLM2-135M-Instruct), shipped in the package."""
    return SHIPPED_HEAD_DIR


class FeatureHeadProposer:
    name = "eagle"

    def __init__(self, head: DraftHead, tree_width: int = 1, compiled: bool = False):
        self.head = head.eval().requires_grad_(False)
        self.tree_width = tree_width  # children per tree node (1: chains)
        self._step = self._compiled_step() if compiled else head.step

    @classmethod
    def from_pretrained(cls, head_dir: str | Path | None, verifier_model: Transformer,
                        tree_width: int = 1) -> "FeatureHeadProposer":
        """Load a head saved by `DraftHead.save` (None = the shipped one) onto `verifier_model`;
        its step is compiled where the verifier's passes are (an int4 verifier, not eager)."""
        head = DraftHead.load(head_dir or shipped_head_dir(), verifier_model)
        compiled = head.head_q8 is not None and getattr(getattr(verifier_model, "token_pass", None), "compiled", False)
        return cls(head, tree_width, compiled)

    def with_width(self, tree_width: int) -> "FeatureHeadProposer":
        """The same head, its step compiled or not as here, drafting trees tree_width wide."""
        other = copy.copy(self)
        other.tree_width = tree_width
        return other

    def _compiled_step(self) -> CompiledMethod:
        """The head's step as one compiled graph for any number of rows: eagerly its ~40 small ops
        cost more than its matmuls. Compiled now, at start-up, not in a request: one graph for a
        first step (the verifier's fused features) and one for the later steps."""
        step = CompiledMethod(self.head.step, key=lambda feat, tok: (feat.dtype, feat.device, feat.shape[1:], tok.dtype),
                              unbacked=lambda feat, tok: (feat, tok))
        w = self.head.head_weight
        tok = torch.zeros(1, dtype=torch.long, device=w.device)
        with torch.no_grad():  # as propose runs it: grad mode is part of the compiled code's key
            for parts in {len(self.head.cfg.feature_layers) + 1, 1}:
                step(w.new_zeros(1, parts * self.head.cfg.dim), tok)
        return step

    def free(self, seq_id: str) -> None:
        pass

    @torch.no_grad()
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        out = [Proposal([], None) for _ in requests]
        live = [i for i, r in enumerate(requests) if r.num_speculative_tokens > 0 and r.feature is not None]
        if not live:
            return out
        dev, dt = self.head.head_weight.device, self.head.head_weight.dtype
        feat = torch.stack([requests[i].feature.reshape(-1) for i in live]).to(dev, dt)  # [B, dim]
        tok = torch.tensor([requests[i].tokens[-1] for i in live], dtype=torch.long, device=dev)  # [B]
        draft = self._chains if self.tree_width == 1 else self._trees
        for i, p in zip(live, draft([requests[i] for i in live], feat, tok)):
            out[i] = p
        return out

    def _chains(self, reqs: list[ProposeRequest], feat: Tensor, tok: Tensor) -> list[Proposal]:
        """Up to K drafts each, one after another: the head's argmax, for sampled requests too, so
        q is one-hot and a sampled request keeps a draft with the verifier's probability of it.
        Drawn from the head's own q instead, sampled drafts were kept no more often and cost a
        transform of q per step and a residual per position (paired 24-prompt A/Bs, adaptive
        vs K=0 at T=0.7: 0.976x and 1.008x drawn, 1.052x and 1.082x as argmax)."""
        out = [Proposal([], None, scores=[]) for _ in reqs]
        ks = [r.num_speculative_tokens for r in reqs]
        floors = [r.min_confidence for r in reqs]
        conf = torch.ones(len(reqs), device=feat.device)  # each chain's probability so far
        steps: list[tuple[Tensor, Tensor]] = []  # per step: (tokens [B], chain probabilities [B])
        for depth in range(1, max(ks) + 1):
            # the predicted next feature [B, dim], its draft logits [B, Vd], the argmax and its probability
            feat, _, tok, p_tok = self._step(feat, tok)
            conf = conf * p_tok
            steps.append((tok, conf))
            if any(floors) and not _deepens(ks, depth, conf.tolist(), floors):
                break  # no chain goes deeper
        # one host sync for the whole chain (and one a step while a floor may stop it)
        toks, confs = (torch.stack(x).tolist() for x in zip(*steps))  # [steps][B]
        for b, (k, f) in enumerate(zip(ks, floors)):
            n = 1  # the first draft always; the later ones while the chain is sure enough
            while n < min(k, len(toks)) and confs[n][b] >= f:
                n += 1
            out[b].token_ids, out[b].scores = [t[b] for t in toks[:n]], [c[b] for c in confs[:n]]
        return out

    def _trees(self, reqs: list[ProposeRequest], feat: Tensor, tok: Tensor) -> list[Proposal]:
        """A tree each, up to K deep: at every depth the w likeliest paths (by the head's
        probability of the whole path) among the children of the w kept at the depth before, each
        with its w likeliest next tokens (EAGLE-2's expansion). Candidates are deterministic, so q
        is one-hot and sampled requests verify them by multi-candidate rejection (tree_sampler)."""
        head, w, B = self.head, self.tree_width, len(reqs)
        ks = [r.num_speculative_tokens for r in reqs]
        logp = torch.zeros(B, 1, device=feat.device)  # [B, rows] each kept path's log-probability
        # node index of each kept row (-1: the root, None: a path dropped under the floor)
        level: list[list[int | None]] = [[-1] for _ in range(B)]
        nodes: list[list[tuple[int, int, float]]] = [[] for _ in range(B)]  # (token, parent, score)
        floors = [r.min_confidence for r in reqs]
        for step in range(max(ks)):
            if step and any(floors) and not _deepens(ks, step, logp[:, 0].exp().tolist(), floors):
                break  # no tree goes deeper: a node past the first level needs a path that sure
            feat, logits, _, _ = self._step(feat, tok)  # [B * rows, dim], [B * rows, Vd]
            lp = torch.log_softmax(logits, dim=-1)
            top_lp, top_i = lp.topk(w, dim=-1)  # [B * rows, w]
            cand = (logp.reshape(-1, 1) + top_lp).view(B, -1)  # [B, rows * w]
            logp, pick = cand.topk(w, dim=-1)  # [B, w] the w likeliest paths one deeper
            row = pick // w  # [B, w] which kept row each extends
            tok = head.vocab_ids[top_i.view(B, -1).gather(1, pick)]  # [B, w]
            feat = feat.view(B, -1, feat.shape[-1]).gather(1, row[..., None].expand(-1, -1, feat.shape[-1]))
            feat, tok = feat.reshape(B * w, -1), tok.reshape(-1)
            prev, level = level, [[] for _ in range(B)]
            for b, (ts, rs, ls) in enumerate(zip(tok.view(B, w).tolist(), row.tolist(), logp.exp().tolist())):
                for t, r, sc in zip(ts, rs, ls):
                    # a path below the floor is dropped, and with it its children (never likelier)
                    keep = step < ks[b] and (step == 0 or (sc >= floors[b] and prev[b][r] is not None))
                    level[b].append(len(nodes[b]) if keep else None)
                    if keep:
                        nodes[b].append((t, prev[b][r], sc))
        return [_preorder(n) for n in nodes]


def _deepens(ks: list[int], depth: int, best: list[float], floors: list[float]) -> bool:
    """Some row may draft past `depth` (its K allows it) along a path whose probability, best[b],
    stays at its floor with a next draft of NEXT_DRAFT_CONFIDENCE (with no floor: always)."""
    return any(k > depth and p * NEXT_DRAFT_CONFIDENCE >= f for k, p, f in zip(ks, best, floors))


def _preorder(nodes: list[tuple[int, int, float]]) -> Proposal:
    """A tree given level by level, (token, parent, score) with parents first, as a Proposal in
    depth-first order, likeliest child first: the likeliest path then sits at the rows of its own
    positions (kept without moving its K/V) and is one run of the attention kernel."""
    children: list[list[int]] = [[] for _ in range(len(nodes) + 1)]
    for j, (_, parent, _) in enumerate(nodes):
        children[parent + 1].append(j)
    order, new_index, stack = [], {}, list(reversed(children[0]))
    while stack:
        j = stack.pop()
        new_index[j] = len(order)
        order.append(j)
        stack += sorted(children[j + 1], key=lambda c: nodes[c][2])  # likeliest popped first
    return Proposal([nodes[j][0] for j in order], None, [new_index.get(nodes[j][1], -1) for j in order],
                    [nodes[j][2] for j in order])
