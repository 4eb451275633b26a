"""A small draft model proposes K tokens autoregressively, batched across sequences."""
from __future__ import annotations

import torch

from specdec.models.runner import ModelRunner
from specdec.protocol import Proposal, ProposeRequest
from specdec.sampling import draw, logits_to_probs, round_generator


class DraftModelProposer:
    name = "draft"

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def free(self, seq_id: str) -> None:
        self.runner.free(seq_id)

    @torch.no_grad()
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        out = [Proposal([], None) for _ in requests]
        live = [i for i, r in enumerate(requests) if r.num_speculative_tokens > 0]
        if not live:
            return out
        ids = [requests[i].seq_id for i in live]
        # the draft cache lags by whatever the verifier accepted plus its bonus token: catch up first
        last = self.runner.catch_up(ids, [requests[i].tokens for i in live],
                                    [requests[i].num_speculative_tokens for i in live])
        gens = {i: None if requests[i].params.greedy else
                round_generator(requests[i].params.seed, len(requests[i].tokens), "draft", self.runner.device)
                for i in live}
        probs: dict[int, list] = {i: [] for i in live}
        step_inputs = last
        for step in range(max(requests[i].num_speculative_tokens for i in live)):
            logits = self.runner.last_logits(ids, [[t] for t in step_inputs])  # [B, V]
            next_tokens = []
            # the greedy rows' argmax in one op and one copy to the host (one per row would wait on the device each time)
            argmax = logits.argmax(dim=-1).tolist() if any(requests[i].params.greedy for i in live) else None
            for row, i in enumerate(live):
                p = requests[i].params
                if p.greedy:
                    tok = argmax[row]
                else:
                    q = logits_to_probs(logits[row : row + 1], p)[0]  # [V]
                    tok = int(draw(q, gens[i]))
                    probs[i].append(q)
                out[i].token_ids.append(tok)
                next_tokens.append(tok)
            # sequences that have all their K drafts drop out of the next step
            keep = [j for j, i in enumerate(live) if len(out[i].token_ids) < requests[i].num_speculative_tokens]
            live = [live[j] for j in keep]
            ids = [ids[j] for j in keep]
            step_inputs = [next_tokens[j] for j in keep]
            if not live:
                break
        for i, plist in probs.items():
            if plist:
                out[i].probs = torch.stack(plist)  # [K, V]
        return out
