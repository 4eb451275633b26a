"""The verifier: one batched forward pass over every sequence's proposals, then rejection sampling."""
from __future__ import annotations

import time
from collections import deque

import torch

from specdec.models.runner import ModelRunner
from specdec.protocol import VerifyRequest, VerifyResult
from specdec.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample
from specdec.sampling import logits_to_probs, round_generator


class Verifier:
    def __init__(self, runner: ModelRunner, history: int = 4096):
        self.runner = runner
        self.batch_sizes: deque[int] = deque(maxlen=history)  # sequences per verifier pass
        self.passes = 0  # verifier forward passes (verify rounds) so far
        self.busy_s = 0.0  # time spent inside verify()

    def free(self, seq_id: str) -> None:
        self.runner.free(seq_id)

    @torch.no_grad()
    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        t0 = time.perf_counter()
        ids = [r.seq_id for r in requests]
        ks = [len(r.draft_token_ids) for r in requests]
        steps = [r.num_steps if k == 0 else 1 for r, k in zip(requests, ks)]
        last = self.runner.catch_up(ids, [r.tokens for r in requests], [max(k + 1, n) for k, n in zip(ks, steps)])
        inputs = [[t] + r.draft_token_ids for t, r in zip(last, requests)]  # [B, K_i + 1] ragged
        hidden, valid = self.runner.forward(ids, inputs)  # [B, T, dim]
        hidden = hidden[valid]  # [sum(K_i + 1), dim], only the real rows
        out = self._sample(requests, ks, self.runner.model.logits(hidden), step=0)  # logits [sum(K_i + 1), V]
        results, r0 = [], 0
        for b, k in enumerate(ks):
            toks = [int(t) for t in out[b] if t != PLACEHOLDER_TOKEN_ID]
            n = len(toks) - 1
            # row n of this request produced its last token; its feature seeds the next draft
            results.append(VerifyResult(toks, n, k, hidden[r0 + n].float().cpu().clone()))
            r0 += k + 1
        self.passes += 1
        self.batch_sizes.append(len(requests))
        if max(steps) > 1:
            self._decode_more(requests, results, steps)
        self.busy_s += time.perf_counter() - t0
        return results

    def _sample(self, requests: list[VerifyRequest], ks: list[int], logits: torch.Tensor, step: int) -> torch.Tensor:
        """Rejection-sample each request's block of K_i + 1 rows of logits; `step` > 0 is a
        further plain step, whose generator is the one a separate round at that position would use."""
        rows, r0 = [], 0
        for r, k in zip(requests, ks):
            block = logits[r0 : r0 + k + 1]
            rows.append(block if r.params.greedy else logits_to_probs(block, r.params))
            r0 += k + 1
        gens = [None if r.params.greedy else
                round_generator(r.params.seed, len(r.tokens) + step, "verify", self.runner.device) for r in requests]
        drafts = torch.tensor([t for r in requests for t in r.draft_token_ids] if step == 0 else [],
                              dtype=torch.long, device=logits.device)
        probs = [r.draft_probs for r in requests] if step == 0 else [None] * len(requests)
        return rejection_sample(drafts, ks, probs, torch.cat(rows), [r.params.greedy for r in requests], gens)

    def _decode_more(self, requests: list[VerifyRequest], results: list[VerifyResult], steps: list[int]) -> None:
        """Steps 2..num_steps of plain decoding, batched over the requests that asked for them.
        Each step samples exactly as a separate draft-free round would (same rejection-sampler
        path, same per-position generator), so output does not depend on num_steps."""
        for step in range(1, max(steps)):
            idx = [b for b, n in enumerate(steps) if n > step]
            ids = [requests[b].seq_id for b in idx]
            hidden, _ = self.runner.forward(ids, [[results[b].token_ids[-1]] for b in idx])  # [B', 1, dim]
            hidden = hidden[:, 0]  # [B', dim]
            out = self._sample([requests[b] for b in idx], [0] * len(idx), self.runner.model.logits(hidden), step)
            for j, b in enumerate(idx):  # out: [B', 1]
                results[b].token_ids.append(int(out[j, 0]))
                results[b].num_passes += 1
                if step == steps[b] - 1:  # its last step: this feature seeds the next draft
                    results[b].feature = hidden[j].float().cpu().clone()
            self.passes += 1
            self.batch_sizes.append(len(idx))
