"""The messages between whoever drives the rounds and the proposer / verifier.

Plain dataclasses so they cross process boundaries (Ray) unchanged. Every request carries the
sequence's full token list: drafter and verifier caches are soft state rebuilt from it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

from specdec.sampling import SamplingParams


@dataclass
class ProposeRequest:
    seq_id: str  # stable id of the sequence (the request id)
    tokens: list[int]  # prompt + output so far, authoritative
    num_speculative_tokens: int  # K for this round (0 = propose nothing)
    params: SamplingParams  # the request's sampling settings (q uses the same transform as p)
    feature: Tensor | None = None  # [dim] verifier hidden state that predicted tokens[-1] (EAGLE-style heads; led by its feature layers' when the head reads them)
    # a draft past the first only where the draft's probability of its path is at least this
    # (0: K deep; heads that score their drafts stop deepening there, others draft K)
    min_confidence: float = 0.0


@dataclass
class Proposal:
    token_ids: list[int]  # the K draft tokens (a tree's nodes: each after its parent)
    probs: Tensor | None  # [K, V] draft distributions q; None = one-hot at token_ids
    # a token tree: each draft's parent among the drafts (-1: the sequence's last token); None: a chain
    parents: list[int] | None = None
    # each draft's confidence: the draft's probability of its path (None: unknown); adaptive
    # speculation keeps the drafts whose calibrated confidence pays for their place in the pass
    scores: list[float] | None = None


@dataclass
class VerifyRequest:
    seq_id: str
    tokens: list[int]  # prompt + output so far, authoritative
    draft_token_ids: list[int]  # K proposed tokens (may be empty: plain decoding)
    draft_probs: Tensor | None  # [K, V] or None for one-hot q
    params: SamplingParams
    # passes in this one call (vLLM's multi-step scheduling), so the per-call overhead of a remote
    # verifier is paid once per several tokens: the first verifies the drafts (if any), the rest
    # are plain decoding steps from where it left the sequence
    num_steps: int = 1
    # tokens that end the sequence (EOS, stop ids): plain steps stop after sampling one
    stop_ids: tuple[int, ...] = ()
    draft_parents: list[int] | None = None  # a token tree's parents (Proposal.parents); None: a chain
    # drafts the verifier makes itself before each pass of the call, with its own draft head (an
    # EAGLE-style head reads the verifier's hidden states: drafting next to them costs no call)
    self_draft: int = 0
    feature: Tensor | None = None  # what the verifier's head drafts from first (ProposeRequest.feature)
    room: int | None = None  # tokens the sequence may still emit: self-drafting passes stop there
    draft_passes: int | None = None  # how many of the call's passes self-draft (None: all; a probe's: its first)
    draft_min_confidence: float = 0.0  # the self-drafts' ProposeRequest.min_confidence
    # a prediction the self-drafting passes copy from before the head drafts (Sequence.prediction),
    # and where the output starts in tokens (a copy aligns the output with the prediction)
    prediction: np.ndarray | None = None
    output_start: int = 0


@dataclass
class TokenLogprob:
    """An emitted token's log-probability under the verifier's raw distribution (before
    temperature, top-k and top-p, as vLLM reports by default), with the likeliest alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), likeliest first; as many as asked


@dataclass
class VerifyResult:
    token_ids: list[int]  # accepted drafts, one recovered or bonus token, then any further plain steps
    num_accepted: int  # drafts accepted (len(token_ids) - 1)
    num_drafted: int  # K of this round
    feature: Tensor | None = None  # [dim] verifier hidden state that predicted the last emitted token (as ProposeRequest.feature)
    num_passes: int = 1  # verifier forward passes that produced token_ids (at most num_steps of the request)
    logprobs: list[TokenLogprob] | None = None  # [len(token_ids)] when the request's params ask for them
    passes_s: list[float] | None = None  # seconds of each of the call's passes (its first: the verify pass)
    path: list[int] | None = None  # a tree's accepted drafts, by index, root to leaf (a chain's: its first num_accepted)
    # a self-drafting call's passes: (drafts, accepted, positions drafted, copied from the
    # prediction) each; num_drafted and num_accepted are their sums
    per_pass: list[tuple[int, int, int, bool]] | None = None
    draft_s: float = 0.0  # seconds the verifier spent drafting with its own head in this call
