"""The verifier: one batched forward pass over every sequence's proposals, then rejection sampling,
then any further passes the call asked for (multi-step scheduling): plain decoding steps, or passes
over drafts its own draft head makes before each (an EAGLE-style head drafts next to the hidden
states it reads)."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque

import torch
from torch import Tensor

from specdec.models.layers import draft_depth
from specdec.models.runner import ModelRunner
from specdec.proposers.ngram import predicted
from specdec.protocol import ProposeRequest, TokenLogprob, VerifyRequest, VerifyResult
from specdec.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample
from specdec.sampling import argmax_rows, logits_to_probs, round_generator
from specdec.tree_sampler import greedy_path, sampled_path

log = logging.getLogger(__name__)


def token_logprobs(logits: Tensor, token_ids: list[int], n: int) -> list[TokenLogprob]:
    """Each token's log-probability under the raw logits of the row that produced it, and the
    row's n likeliest tokens. logits [T, V], token_ids [T]."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
    chosen = lp[torch.arange(len(token_ids), device=lp.device), torch.tensor(token_ids, device=lp.device)].tolist()  # [T]
    top_lp, top_ids = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())  # [T, n]
    return [TokenLogprob(t, c, list(zip(i, v))) for t, c, i, v in zip(token_ids, chosen, top_ids.tolist(), top_lp.tolist())]


def _targets(requests: list[VerifyRequest], ks: list[int], logits: Tensor) -> Tensor:
    """[sum(K_i + 1), V] what the rejection sampler judges by: greedy requests' rows as logits
    (their argmax is p's), sampled requests' as probabilities under their own parameters, all of
    those in one batched transform."""
    sampled = [(r0, k, r.params) for r0, k, r in zip(itertools.accumulate((k + 1 for k in ks), initial=0), ks, requests)
               if not r.params.greedy]
    if not sampled:
        return logits
    rows = [r0 + j for r0, k, _ in sampled for j in range(k + 1)]
    params = [p for _, k, p in sampled for _ in range(k + 1)]
    if len(rows) == logits.shape[0]:
        return logits_to_probs(logits, params)
    target = logits.float().clone()
    target[rows] = logits_to_probs(logits[rows], params)
    return target


class Verifier:
    def __init__(self, runner: ModelRunner, history: int = 4096, drafter=None):
        self.runner = runner
        # a draft head that lives with the model (its features never leave): drafts for requests
        # that ask for them (VerifyRequest.self_draft)
        self.drafter = drafter
        self.draft_failures = 0  # calls to the draft head that raised (their passes went without drafts)
        self.batch_sizes: deque[int] = deque(maxlen=history)  # sequences per verifier pass
        self.passes = 0  # verifier forward passes (verify rounds) so far
        self.busy_s = 0.0  # time spent inside verify() and prompt_logprobs()

    def free(self, seq_id: str) -> None:
        self.runner.free(seq_id)

    @torch.no_grad()
    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        t0 = time.perf_counter()
        results = self._compute(requests)
        self.busy_s += time.perf_counter() - t0
        return results

    @torch.no_grad()
    def prompt_logprobs(self, seq_id: str, tokens: list[int], n: int, chunk: int = 256) -> list[TokenLogprob]:
        """[len(tokens) - 1]: each of tokens[1:]'s log-probability given the tokens before it, with
        its position's n likeliest tokens (a completions request's `echo` with `logprobs`; the
        first token has none). Every position is computed afresh (a cached prefix has K/V but no
        logits), a chunk at a time so that logits stay [chunk, V]; the slot keeps the K/V, so
        generating from these tokens next finds them cached."""
        t0 = time.perf_counter()
        self.free(seq_id)
        self.runner.sync([seq_id], [tokens], [0])  # a new slot without a reused prefix
        out: list[TokenLogprob] = []
        for j in range(0, len(tokens) - 1, chunk):
            x = tokens[j : min(j + chunk, len(tokens) - 1)]
            hidden, _ = self.runner.forward([seq_id], [x])  # [1, c, dim]
            out += token_logprobs(self.runner.model.logits(hidden[0]), tokens[j + 1 : j + 1 + len(x)], n)  # [c, V]
        self.busy_s += time.perf_counter() - t0
        return out

    def _compute(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        """One pass over the requests' drafts, then their further steps: plain decoding, or passes
        that verify the verifier's own drafts where a request asks for them (self_draft)."""
        steps, passes_s, draft_s = [r.num_steps for r in requests], [], [0.0]
        drafted, copied = self._own_drafts(requests, draft_s)
        results = self._pass(drafted, passes_s)
        if any(r.self_draft for r in requests):
            for res, r, c in zip(results, drafted, copied):
                res.per_pass = [(res.num_drafted, res.num_accepted, draft_depth(r.draft_token_ids, r.draft_parents), c)]
            self._draft_more(requests, results, steps, passes_s, draft_s)
        elif max(steps) > 1:
            for r, res in zip(requests, results):
                if res.num_drafted:  # continue after the accepted drafts: the rejected ones' rows get overwritten
                    self.runner.truncate(r.seq_id, len(r.tokens) + len(res.token_ids) - 1)
            self._decode_more(requests, results, steps, passes_s)
        for res in results:
            res.passes_s, res.draft_s = passes_s, draft_s[0]
        return results

    def _pass(self, requests: list[VerifyRequest], passes_s: list[float]) -> list[VerifyResult]:
        """One forward pass over each request's last token and drafts, then rejection sampling."""
        ids = [r.seq_id for r in requests]
        ks = [len(r.draft_token_ids) for r in requests]
        # positions written at most: the last token and K drafts, or K accepted + the plain steps after
        last = self.runner.catch_up(ids, [r.tokens for r in requests],
                                    [k + (1 if r.self_draft else r.num_steps) for k, r in zip(ks, requests)])
        t_pass = time.perf_counter()
        inputs = [[t] + r.draft_token_ids for t, r in zip(last, requests)]  # [B, K_i + 1] ragged
        trees = [None if r.draft_parents is None else [-1] + [p + 1 for p in r.draft_parents] for r in requests]
        hidden, valid = self.runner.forward(ids, inputs, trees)  # [B, T, dim]
        hidden = hidden[valid]  # [sum(K_i + 1), dim], only the real rows
        logits = self.runner.model.logits(hidden)  # [sum(K_i + 1), V]
        toks, paths = self._verify_sample(requests, ks, logits)
        for r, t, path in zip(requests, trees, paths):
            if t is not None:  # the accepted path's K/V to the rows of its positions
                self.runner.keep_path(r.seq_id, len(r.tokens) - 1, [0] + [c + 1 for c in path])
        # the row that produced a request's last token seeds its next draft (gathered and copied
        # to the host at once: a copy per request waits on the device each time; in the model's
        # dtype, which loses nothing and halves what a remote Drafter is sent in bfloat16)
        starts = list(itertools.accumulate((k + 1 for k in ks), initial=0))  # each block's first row
        rows = [[r0] + [r0 + c + 1 for c in path] for r0, path in zip(starts, paths)]  # row j produced token j
        feats = hidden[[r[-1] for r in rows]].cpu()  # [B, dim]
        results = []
        for b, k in enumerate(ks):
            tree = requests[b].draft_parents is not None
            results.append(VerifyResult(toks[b], len(toks[b]) - 1, k, feats[b].clone(), path=paths[b] if tree else None))
            if requests[b].params.logprobs is not None:
                results[b].logprobs = token_logprobs(logits[rows[b]], toks[b], requests[b].params.logprobs)
        self.passes += 1
        self.batch_sizes.append(len(requests))
        passes_s.append(time.perf_counter() - t_pass)
        return results

    def _own_drafts(self, requests: list[VerifyRequest], draft_s: list[float]) -> tuple[list[VerifyRequest], list[bool]]:
        """The requests with their own drafts where they ask for them (and carry none): copied
        from a prediction where the output meets it, else the verifier's own head's (none for a
        sequence without a feature yet); and which requests' drafts were copied."""
        out, copied = list(requests), [False] * len(requests)
        for i, r in enumerate(requests):
            if r.self_draft and not r.draft_token_ids and r.prediction is not None:
                x = predicted(r.prediction, r.tokens[r.output_start:], r.self_draft)
                out[i], copied[i] = dataclasses.replace(r, draft_token_ids=x, draft_probs=None, draft_parents=None), bool(x)
        asks = [i for i, r in enumerate(requests)
                if r.self_draft and not r.draft_token_ids and not copied[i] and r.feature is not None]
        if asks and self.drafter is not None:
            self._head_drafts(out, asks, draft_s)
        return out, copied

    def _head_drafts(self, out: list[VerifyRequest], asks: list[int], draft_s: list[float]) -> None:
        """The verifier's own head drafts for out[i], i in asks (in place); a failing head costs
        speed, not a request: those passes go without drafts."""
        t0 = time.perf_counter()
        try:
            props = self.drafter.propose([ProposeRequest(r.seq_id, r.tokens, r.self_draft, r.params, r.feature,
                                                         r.draft_min_confidence) for r in (out[i] for i in asks)])
        except Exception:
            self.draft_failures += 1
            log.warning("the draft head failed; this pass verifies no drafts", exc_info=True)
            return
        finally:
            draft_s[0] += time.perf_counter() - t0
        for i, p in zip(asks, props):
            out[i] = dataclasses.replace(out[i], draft_token_ids=p.token_ids, draft_probs=p.probs,
                                         draft_parents=p.parents)

    @staticmethod
    def _next_k(request: VerifyRequest, result: VerifyResult, left: int) -> int:
        """Drafts for a call's next pass: at most one past the run its last pass accepted (no
        round between passes re-plans K, and a K chosen on a good stretch would otherwise draft
        deep for every pass of the call after the stretch ends), within what the sequence may
        still emit."""
        if request.draft_passes is not None and len(result.per_pass) >= request.draft_passes:
            return 0
        return max(0, min(request.self_draft, result.per_pass[-1][1] + 1, left - 1))

    def _draft_more(self, requests: list[VerifyRequest], results: list[VerifyResult], steps: list[int],
                    passes_s: list[float], draft_s: list[float]) -> None:
        """Passes 2..num_steps of a self-drafting call: each request drafts again from where its
        last pass left it, as many as it may still emit allow, and one pass verifies them all."""
        for step in range(1, max(steps)):
            left = [(r.room if r.room is not None else r.num_steps) - len(res.token_ids)
                    for r, res in zip(requests, results)]
            idx = [b for b, r in enumerate(requests) if steps[b] > step and left[b] > 0
                   and not any(t in r.stop_ids for t in results[b].token_ids)]
            if not idx:
                break
            sub = [dataclasses.replace(requests[b], tokens=requests[b].tokens + results[b].token_ids, draft_token_ids=[],
                                       draft_probs=None, draft_parents=None, feature=results[b].feature,
                                       self_draft=self._next_k(requests[b], results[b], left[b]))
                   for b in idx]
            sub, copied = self._own_drafts(sub, draft_s)
            for b, r, c, res in zip(idx, sub, copied, self._pass(sub, passes_s)):
                mine = results[b]
                mine.token_ids += res.token_ids
                mine.num_accepted += res.num_accepted
                mine.num_drafted += res.num_drafted
                mine.num_passes += 1
                mine.feature = res.feature
                mine.per_pass.append((res.num_drafted, res.num_accepted, draft_depth(r.draft_token_ids, r.draft_parents), c))
                if mine.logprobs is not None:
                    mine.logprobs += res.logprobs

    def _verify_sample(self, requests: list[VerifyRequest], ks: list[int], logits: Tensor) -> tuple[list, list]:
        """(emitted tokens, accepted drafts' indices) per request, from its block of K_i + 1 rows:
        chains through the batched rejection sampler, token trees along their accepted path."""
        tree = [b for b, r in enumerate(requests) if r.draft_parents is not None]
        chain = [b for b, r in enumerate(requests) if r.draft_parents is None]
        starts = list(itertools.accumulate((k + 1 for k in ks), initial=0))
        toks: list = [None] * len(requests)
        paths: list = [None] * len(requests)
        if chain:
            sub = [requests[b] for b in chain]
            rows = logits if not tree else logits[[starts[b] + j for b in chain for j in range(ks[b] + 1)]]
            out = self._sample(sub, [ks[b] for b in chain], rows, step=0)  # [B', max(K_i) + 1], placeholder-padded
            for b, row in zip(chain, out.tolist()):
                toks[b] = [t for t in row if t != PLACEHOLDER_TOKEN_ID]
                paths[b] = list(range(len(toks[b]) - 1))
        if tree:
            sub = [requests[b] for b in tree]
            blocks = [list(range(starts[b], starts[b + 1])) for b in tree]
            target = _targets(sub, [ks[b] for b in tree], logits[[i for blk in blocks for i in blk]])
            argmax = argmax_rows(target) if any(r.params.greedy for r in sub) else None  # one call for all
            i0 = 0
            for b, r, blk in zip(tree, sub, blocks):
                if r.params.greedy:
                    toks[b], paths[b] = greedy_path(r.draft_token_ids, r.draft_parents, argmax[i0 : i0 + len(blk)])
                else:
                    gen = round_generator(r.params.seed, len(r.tokens), "verify", self.runner.device)
                    toks[b], paths[b] = sampled_path(r.draft_token_ids, r.draft_parents, target[i0 : i0 + len(blk)], gen)
                i0 += len(blk)
        return toks, paths

    def _sample(self, requests: list[VerifyRequest], ks: list[int], logits: torch.Tensor, step: int,
                positions: list[int] | None = None) -> torch.Tensor:
        """Rejection-sample each request's block of K_i + 1 rows of logits; `step` > 0 is a
        further plain step, whose generator is the one a separate round at that position would use
        (positions[i]: the index its token will have; default len(tokens) + step)."""
        target = _targets(requests, ks, logits)
        positions = positions or [len(r.tokens) + step for r in requests]
        gens = [None if r.params.greedy else round_generator(r.params.seed, pos, "verify", self.runner.device)
                for r, pos in zip(requests, positions)]
        drafts = torch.tensor([t for r in requests for t in r.draft_token_ids] if step == 0 else [],
                              dtype=torch.long)  # on the host: the sampler reads them there
        probs = [r.draft_probs for r in requests] if step == 0 else [None] * len(requests)
        return rejection_sample(drafts, ks, probs, target, [r.params.greedy for r in requests], gens)

    def _decode_more(self, requests: list[VerifyRequest], results: list[VerifyResult], steps: list[int],
                     passes_s: list[float]) -> None:
        """Steps 2..num_steps of plain decoding, batched over the requests that asked for them,
        each from its result so far (a verified request's: after its accepted drafts and recovered
        or bonus token). Each step samples exactly as a separate draft-free round would (same
        rejection-sampler path, same per-position generator), so output does not depend on
        num_steps. A request stops early after a stop token."""
        for step in range(1, max(steps)):
            t_pass = time.perf_counter()
            idx = [b for b, n in enumerate(steps) if n > step and results[b].token_ids[-1] not in requests[b].stop_ids]
            if not idx:
                break
            ids = [requests[b].seq_id for b in idx]
            hidden, _ = self.runner.forward(ids, [[results[b].token_ids[-1]] for b in idx])  # [B', 1, dim]
            hidden = hidden[:, 0]  # [B', dim]
            logits = self.runner.model.logits(hidden)  # [B', V]
            out = self._sample([requests[b] for b in idx], [0] * len(idx), logits, step,
                               [len(requests[b].tokens) + len(results[b].token_ids) for b in idx])
            feats = hidden.cpu()  # [B', dim]
            for j, b in enumerate(idx):  # out: [B', 1]
                results[b].token_ids.append(int(out[j, 0]))
                results[b].num_passes += 1
                if results[b].logprobs is not None:
                    results[b].logprobs += token_logprobs(logits[j : j + 1], [int(out[j, 0])], requests[b].params.logprobs)
                # the last step's feature seeds the next draft (one that stops early at a stop token
                # ends its sequence, which drafts no more)
                if step == steps[b] - 1:
                    results[b].feature = feats[j].clone()
            self.passes += 1
            self.batch_sizes.append(len(idx))
            passes_s.append(time.perf_counter() - t_pass)
