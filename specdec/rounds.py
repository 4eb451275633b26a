"""One speculative round for a batch of sequences, independent of where the models run.

The in-process engine calls proposer and verifier directly; the Serve ingress calls remote
replicas. Both use this: plan K per sequence, build the propose and verify requests, commit.

With `lookup` (an n-gram proposer, typically needing a 3-token match), a sequence bound to a
model proposer first tries prompt lookup: where its recent tokens occur earlier in its own
context (extractive answers, code edits, repeated names) the continuation is copied as the
drafts, for free, and the model proposer is not called for it that round. Which proposer drafts
depends only on the tokens so far, so the output distribution is unchanged. A sequence with a
prediction (OpenAI's Predicted Outputs) copies from it first, the same way, with or without a
model proposer."""
from __future__ import annotations

import time

from specdec.adaptive import AdaptiveK
from specdec.confidence import MIN_PATH_CONFIDENCE, prune, subset
from specdec.models.layers import draft_depth
from specdec.proposers.ngram import NgramProposer, predicted
from specdec.protocol import Proposal, ProposeRequest, VerifyRequest, VerifyResult
from specdec.sequence import Delta, Sequence


def copied_drafts(s: Sequence, budget: int, lookup: NgramProposer | None, proposer: str | None,
                  prediction: bool = True) -> tuple[list[int], bool]:
    """A sequence's drafts copied this round, and whether from its prediction: from there (if
    `prediction`) where the output meets it, else by prompt lookup (not for the ngram proposer,
    which is lookup itself); [] if neither matches."""
    if not budget:
        return [], False
    if prediction and s.prediction is not None and (x := predicted(s.prediction, s.output_ids, budget)):
        return x, True
    if lookup is None or proposer == "ngram":
        return [], False
    if s.lookup_index is None:
        s.lookup_index = lookup.index()
    return s.lookup_index.lookup(s.tokens, budget), False


def prediction_pays(adaptive: AdaptiveK, s: Sequence) -> bool:
    """Whether a sequence's prediction drafts rather than its model: while its copies are kept at
    least as often as its model's drafts. A prediction starts trusted (its record shrunk towards
    all kept: the user says the answer repeats it); a loose one (an earlier sampled answer: a
    third of its copies kept, against half of the head's drafts) would otherwise keep the head
    from drafting wherever it meets the output."""
    m = s.metrics
    return adaptive.lookup.of_sequence(m.num_prediction_accepted, m.num_prediction_judged, towards=1.0) >= \
        adaptive.acceptance(m.num_model_accepted, m.num_model_judged)


class Round:
    def __init__(self, batch: list[Sequence], proposer_of: dict[str, str | None], adaptive: AdaptiveK | None,
                 lookup: NgramProposer | None = None, in_verifier: frozenset[str] = frozenset()):
        """in_verifier: proposers that live in the verifier (its own draft head): their sequences'
        drafts are made there, before each pass of the call (VerifyRequest.self_draft)."""
        self.batch = batch
        self.adaptive = adaptive
        self.proposer_of = proposer_of
        budgets = self._copies(proposer_of, adaptive, lookup)
        # a sequence's first verify (and first draft) also prefills its prompt: such rounds would
        # teach the cost models that passes are dearer than they are, so they are not observed
        self.prefill_verify = any(not s.output_ids for s in batch)
        self.first_draft = [not s.metrics.num_model_drafted for s in batch]  # no model draft verified yet
        self.prediction: dict | None = None  # what adaptive K expected of its choice (round traces)
        if adaptive is not None:  # a first round's copy of a prediction goes whole: its pass prefills anyway
            budgets = [b if not s.output_ids else k for s, b, k in zip(batch, budgets, self._choose(adaptive, budgets))]
        # a probe rides along a multi-step plain call: its drafts in the first pass, then every
        # sequence's plain steps (as a drafting round it would cut all of them to one step: one
        # more call for the batch, and an answer out of step with the others)
        self.ride_along = adaptive is not None and adaptive.last_probe
        self.ks = budgets
        # adaptive K's K is how deep the model may draft; the head goes past its first draft only
        # where it is sure (a fixed K drafts K deep)
        self.min_confidence = MIN_PATH_CONFIDENCE if adaptive is not None else 0.0
        self.drafts: list[Proposal] = [Proposal([], None) for _ in batch]
        self.is_lookup = [bool(x) and k > 0 for x, k in zip(self.looked_up, self.ks)]
        for i, (x, k) in enumerate(zip(self.looked_up, self.ks)):
            if self.is_lookup[i]:
                self.drafts[i] = Proposal(x[:k], None)  # one-hot q at the copied tokens
        # drafted in the verifier's call, before each pass; then every call runs several passes (a
        # prompt-lookup copy is verified in the first, plain steps follow)
        self.drafts_in_calls = bool(in_verifier)
        self.head_in_verifier = [proposer_of.get(s.seq_id) in in_verifier for s in batch]
        # a prediction is copied from in every pass of such a call, by the verifier
        self.self_drafted = [k > 0 and ((not m and own) or (self.drafts_in_calls and p))
                             for k, m, own, p in zip(self.ks, self.is_lookup, self.head_in_verifier, self.use_prediction)]
        self.t_draft = 0.0
        self._cost_sample: tuple[int, int, int] | None = None  # (batch, tokens in pass, passes), set by commit
        self._passes_s: list[float] | None = None  # a ridden-along call's pass times (commit)
        self._call_passes_s: list[float] = []  # the verifier call's pass times (commit)
        self._steps_asked = 1  # passes the call was asked for (verify_requests)
        self.t_committed = 0.0

    def _copies(self, proposer_of: dict[str, str | None], adaptive: AdaptiveK | None,
                lookup: NgramProposer | None) -> list[int]:
        """Copies first (cheap): each sequence's copied drafts this round, and its draft budget.
        A sequence with no model proposer drafts only what it copies, and so does one in its first
        round, from its prediction alone: that pass prefills its prompt, and a draft head has no
        verifier feature to draft from yet."""
        first = [not s.output_ids for s in self.batch]
        has = [s.prediction is not None for s in self.batch]
        budgets = [s.draft_budget() if (h if f else proposer_of.get(s.seq_id) or h) else 0
                   for s, f, h in zip(self.batch, first, has)]
        self.use_prediction = [h and (adaptive is None or not proposer_of.get(s.seq_id) or prediction_pays(adaptive, s))
                               for s, h in zip(self.batch, has)]
        copies = [copied_drafts(s, b, lookup, proposer_of.get(s.seq_id), p)
                  for s, b, p in zip(self.batch, budgets, self.use_prediction)]
        self.looked_up = [x for x, _ in copies]
        self.from_prediction = [p for _, p in copies]
        return [b if proposer_of.get(s.seq_id) and not f else min(b, len(x))
                for s, b, x, f in zip(self.batch, budgets, self.looked_up, first)]

    def _choose(self, adaptive: AdaptiveK, budgets: list[int]) -> list[int]:
        """K per sequence from adaptive K, given each one's record and budget."""
        acc = [adaptive.acceptance(s.metrics.num_model_accepted, s.metrics.num_model_judged) for s in self.batch]
        lacc = [adaptive.lookup.of_sequence(s.metrics.num_lookup_accepted, s.metrics.num_lookup_judged)
                for s in self.batch]
        # past its prefill (a draft needs the verifier's feature), never drafted by the model,
        # and with enough left to emit that what its probe shows can still be used
        new = [bool(s.output_ids) and first and s.room() >= adaptive.probe_min_room
               for s, first in zip(self.batch, self.first_draft)]
        ks = adaptive.choose(acc, budgets, new, [len(x) for x in self.looked_up], lacc, prefilling=self.prefill_verify)
        self.prediction = adaptive.last_prediction
        return ks

    def propose_requests(self) -> dict[str, tuple[list[int], list[ProposeRequest]]]:
        """Requests per proposer name: (batch indices, requests)."""
        groups: dict[str, tuple[list[int], list[ProposeRequest]]] = {}
        for i, (s, k) in enumerate(zip(self.batch, self.ks)):
            if k > 0 and not self.is_lookup[i] and not self.self_drafted[i]:
                idx, reqs = groups.setdefault(self.proposer_of[s.seq_id], ([], []))
                idx.append(i)
                reqs.append(ProposeRequest(s.seq_id, list(s.tokens), k, s.params, s.feature, self.min_confidence))
        return groups

    def set_proposals(self, idx: list[int], proposals: list[Proposal], seconds: float) -> None:
        self.observe_draft(idx, max((depth(p) for p in proposals), default=0), seconds)
        if self.adaptive is not None and not self.adaptive.last_probe:  # a probe's drafts are all verified
            proposals = self._prune(idx, proposals)
        for i, p in zip(idx, proposals):
            # a tree's nodes all take cache rows: near the end of the context only those that fit
            # (a prefix of the depth-first order is still a tree)
            room = self.batch[i].max_len - len(self.batch[i].tokens) - 1
            self.drafts[i] = p if len(p.token_ids) <= room else subset(p, set(range(max(room, 0))))

    def _prune(self, idx: list[int], proposals: list[Proposal]) -> list[Proposal]:
        """The drafts whose calibrated confidence pays for their place in the pass (confidence.py)."""
        B, mine = len(self.batch), set(idx)
        tokens = B + sum(len(d.token_ids) for i, d in enumerate(self.drafts) if i not in mine)
        costs = self.adaptive.costs
        return prune(proposals, [self.batch[i].params.greedy for i in idx], self.adaptive.confidence,
                     lambda n: costs.verify(B, tokens + n), B)

    def observe_draft(self, idx: list[int], k: int, seconds: float) -> None:
        """A draft call for batch indices idx, up to k drafts each, took seconds."""
        self.t_draft += seconds
        if self.adaptive is not None and all(self.batch[i].metrics.num_drafted for i in idx):
            self.adaptive.observe_draft(len(idx), k, seconds)

    def verify_requests(self, decode_steps: int = 1, prefill_steps: int | None = None) -> list[VerifyRequest]:
        """decode_steps > 1: ask for that many passes in the one verifier call where no sequence
        needs new drafts from here after its first pass: plain steps, a probe riding along, or
        sequences whose later drafts the verifier makes itself (each capped by what its sequence
        may emit). prefill_steps: at most that many in a round that prefills a prompt (a remote
        verifier's call streams nothing until it returns: 1 sends a new request's first token
        right after its prefill)."""
        drafting = any(d.token_ids for d in self.drafts)
        steps = decode_steps if not drafting or self.ride_along or self.drafts_in_calls else 1
        if self.prefill_verify and prefill_steps is not None:
            steps = min(steps, prefill_steps)
        self._steps_asked = steps
        # what a sequence emits (accepted drafts, their recovered or bonus token, then plain
        # steps) stays within what it may: a draft budget leaves room for one more token
        # (a sequence the verifier drafts for has no drafts here: its passes are capped the same way)
        return [VerifyRequest(s.seq_id, list(s.tokens), d.token_ids, d.probs, s.params,
                              max(1, min(steps, s.room() - depth(d))), stop_ids=tuple(s.stop_ids),
                              draft_parents=d.parents, self_draft=k if own else 0,
                              feature=s.feature if own and head else None, room=s.room(),
                              draft_passes=1 if own and self.ride_along else None,
                              draft_min_confidence=self.min_confidence,
                              prediction=s.prediction if own and p else None, output_start=len(s.prompt_ids))
                for s, d, k, own, head, p in zip(self.batch, self.drafts, self.ks, self.self_drafted,
                                                 self.head_in_verifier, self.use_prediction)]

    def commit(self, results: list[VerifyResult], verify_seconds: float | None) -> list[tuple[Sequence, Delta]]:
        """verify_seconds None: the round's cost is observed later, by observe_cost (Serve: once
        the next round starts, so that what the ingress does between rounds is counted too)."""
        passes = max(r.num_passes for r in results)
        # a multi-step call is observed per pass, and apart from one-pass calls (a self-drafting
        # call's passes are priced as one-pass calls are: by the tokens in each)
        self._cost_sample = None if self.prefill_verify else \
            (len(results), sum(r.num_drafted + 1 for r in results) if not any(self.self_drafted) else
             len(results) + round(sum(r.num_drafted for r in results) / passes), passes)  # a mean pass's tokens
        self._call_passes_s = next((r.passes_s for r in results if r.passes_s), [])
        # a probe that rode along: its verify pass is what is learned ([] if the times are unknown)
        ride_along = passes > 1 and any(r.num_drafted for r in results) and (self.ride_along or not any(self.self_drafted))
        self._passes_s = self._call_passes_s if self._cost_sample and ride_along else None
        self.t_draft += max(r.draft_s for r in results)
        if self.adaptive is not None:
            self._observe_own_drafts(results, passes)
            if verify_seconds is not None:
                self.observe_cost(verify_seconds)
            for j, (drafted_accepted, looked_up, first) in enumerate(self._per_pass(results)):
                self.adaptive.observe_round(drafted_accepted, looked_up, first, self.prediction if j == 0 else None)
            self.adaptive.confidence.observe(self.drafts, results, [s.params.greedy for s in self.batch])
        out = [(s, s.commit(r, m, depth(d) if d.parents is not None else None, m and p))
               for s, r, m, d, p in zip(self.batch, results, self.is_lookup, self.drafts, self.from_prediction)]
        self.t_committed = time.perf_counter()
        return out

    def _observe_own_drafts(self, results: list[VerifyResult], passes: int) -> None:
        """What the verifier's own drafting cost per pass (its head keeps no state: a sequence's
        first draft costs what the others do)."""
        own = [i for i, x in enumerate(self.self_drafted) if x]
        drafting = sum(1 for d, _, _, copied in results[own[0]].per_pass or () if d and not copied) if own else 0
        if drafting and results[own[0]].draft_s:
            self.adaptive.observe_draft(len(own), max(self.ks[i] for i in own), results[own[0]].draft_s / drafting)

    def _per_pass(self, results: list[VerifyResult]):
        """Each pass of the call as a verified round: (drafts, accepted) of its sequences, their
        lookup and first-draft flags."""
        each = [[(pos, n, c or (m and j == 0)) for j, (_, n, pos, c) in enumerate(r.per_pass)] if r.per_pass
                else [(depth(d), r.num_accepted, m)] for r, d, m in zip(results, self.drafts, self.is_lookup)]
        for j in range(max(map(len, each))):
            rows = [i for i, e in enumerate(each) if j < len(e)]
            yield ([each[i][j][:2] for i in rows], [each[i][j][2] for i in rows],
                   [self.first_draft[i] and j == 0 for i in rows])

    def observe_cost(self, seconds: float) -> None:
        """What the committed round's verifier call cost, drafts apart."""
        if self.adaptive is None or self._cost_sample is None:
            return
        batch, tokens, n = self._cost_sample
        passes = self._call_passes_s
        if self._passes_s is not None:
            if not self._passes_s:
                return
            # a verify pass then plain steps in one call: learned as the one-pass call it would
            # have been, the pass and the call's overhead (its plain steps say nothing new); where
            # drafting calls are multi-step too, as one pass of such a call
            share = self._steps_asked if self.drafts_in_calls else 1
            self.adaptive.observe_verify(batch, tokens, self._passes_s[0] + max(0.0, seconds - sum(self._passes_s)) / share)
        elif self._steps_asked > 1 and passes:
            # per pass of the full call it was asked to be: a call cut short (its sequence ended)
            # shares its overhead among fewer passes, and priced so it would mark its K down for good
            per_pass = sum(passes) / len(passes) + max(0.0, seconds - sum(passes)) / self._steps_asked
            self.adaptive.observe_verify(batch, tokens, per_pass, 1 if any(self.self_drafted) else self._steps_asked)
        else:
            self.adaptive.observe_verify(batch, tokens, seconds / n, n)


def depth(p: Proposal) -> int:
    """Positions a proposal drafts: a chain's length, a token tree's depth."""
    return draft_depth(p.token_ids, p.parents)


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0
