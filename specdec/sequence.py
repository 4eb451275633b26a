"""A request being generated: its authoritative token list, stop rules and streamed text.

Whoever drives rounds (the in-process engine, or the Serve ingress) owns these; drafter and
verifier only ever see copies of `tokens`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specdec.metrics import SpecMetrics
from specdec.models.runner import ContextLengthError
from specdec.protocol import TokenLogprob, VerifyResult
from specdec.sampling import SamplingParams


@dataclass
class Delta:
    """What one round added to a sequence's output."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    logprobs: list[TokenLogprob] | None = None  # one per token this round kept, when the request asked for them


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    num_speculative_tokens: int  # K requested for this sequence (0 = plain decoding)
    max_len: int  # context window: prompt + output never exceed it
    eos_token_ids: set[int] = field(default_factory=set)
    decode: object = None  # callable(list[int]) -> str, needed for text and stop strings
    tokens: list[int] = field(init=False)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # output text emitted so far (never past a stop string)
    finish_reason: str | None = None
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    feature: object = None  # verifier feature that predicted tokens[-1] (None until the first pass)
    logprobs: list[TokenLogprob] | None = None  # [len(output_ids)] when params.logprobs is set
    prediction: np.ndarray | None = None  # tokens the output is expected to repeat (drafts, copied); None: none
    lookup_index: object = None  # prompt lookup's index of its tokens (ngram.SuffixIndex), made at its first lookup

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("prompt is empty")
        if len(self.prompt_ids) >= self.max_len:
            raise ContextLengthError(
                f"prompt has {len(self.prompt_ids)} tokens; the context window is {self.max_len} tokens")
        self.tokens = list(self.prompt_ids)
        # an array once, not at every round's lookup in it
        self.prediction = np.asarray(self.prediction, dtype=np.int64) if self.prediction is not None and \
            len(self.prediction) else None
        self.metrics.num_prompt_tokens = len(self.prompt_ids)
        # incremental detokenisation (_output_text): the output up to _read_n decodes to _read_text,
        # and the next window of tokens is decoded from _prefix_n (the round before's boundary)
        self._prefix_n = self._read_n = 0
        self._read_text = ""
        self.stop_ids = set() if self.params.ignore_eos else set(self.eos_token_ids)
        self.stop_ids |= set(self.params.stop_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def room(self) -> int:
        """Tokens this sequence may still emit."""
        return min(self.params.max_tokens - len(self.output_ids), self.max_len - len(self.tokens))

    def draft_budget(self, k: int | None = None) -> int:
        """Drafts worth proposing this round: never more than can still be emitted after the
        verifier's own token, so no pass is spent on tokens that would be cut off."""
        k = self.num_speculative_tokens if k is None else k
        return max(0, min(k, self.room() - 1))

    def commit(self, result: VerifyResult, lookup: bool = False, positions: int | None = None,
               predicted: bool = False) -> Delta:
        """lookup: the round's drafts were copied (counted apart in metrics), predicted: from the
        prediction, not by prompt lookup; positions: a token tree's depth (None: a chain)."""
        if result.per_pass:  # a self-drafting call: a round per pass; the round's own copy in its first
            for j, (drafted, accepted, depth, copied) in enumerate(result.per_pass):  # copied: from the prediction
                first = lookup and j == 0
                self.metrics.record_round(drafted, accepted, 1, copied or first, depth, copied or (first and predicted))
            self.metrics.num_verifier_passes += result.num_passes - len(result.per_pass)
        else:
            self.metrics.record_round(result.num_drafted, result.num_accepted, result.num_passes, lookup, positions,
                                      predicted)
        new: list[int] = []
        for tok in result.token_ids:
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                break
            new.append(tok)
            if len(new) >= self.room():
                self.finish_reason = "length"
                break
        first = len(self.output_ids)
        self.output_ids.extend(new)
        self.tokens.extend(new)
        if self.logprobs is not None:
            self.logprobs += (result.logprobs or [])[: len(new)]
        self.feature = result.feature if len(new) == len(result.token_ids) else None
        text = self._advance_text(len(new))
        now = time.perf_counter()
        if self.metrics.t_first_token is None and (new or self.finished):
            self.metrics.t_first_token = now
        self.metrics.num_output_tokens = len(self.output_ids)
        if self.finished:
            self.metrics.t_finish = now
        return Delta(new, text, self.finished, self.finish_reason,
                     None if self.logprobs is None else self.logprobs[first:])

    def _stop_at(self, text: str) -> int:
        start = max(0, len(self.text) - max(map(len, self.params.stop)))
        hits = [i for i in (text.find(s, start) for s in self.params.stop) if i >= 0]
        return min(hits) if hits else -1

    def _output_text(self) -> str:
        """The output's text, decoded a window at a time (as vLLM does): the tokens since the last
        boundary where the text ended in a whole character, after the window before them as
        context, so that a tokenizer's rules for a leading space apply to both decodes alike.
        Decoding the whole output every round cost ~1 ms a round at 2000 tokens (the embedded
        tokenizer, on a 2-core CPU): quadratic in the answer's length."""
        ids = self.output_ids
        window = self.decode(ids[self._prefix_n :])
        head = self.decode(ids[self._prefix_n : self._read_n]) if self._read_n > self._prefix_n else ""
        full = self._read_text + window[len(head) :]
        if not window.endswith("\ufffd"):  # no half of a multi-byte character at the end
            self._prefix_n, self._read_n, self._read_text = self._read_n, len(ids), full
        return full

    def _advance_text(self, n_new: int) -> str:
        if self.decode is None:
            return ""
        full = self._output_text()
        stops = self.params.stop
        if stops and (cut := self._stop_at(full)) >= 0:
            # drop the tokens after the one that completed the stop string: never emit past a stop
            first = len(self.output_ids) - n_new
            n = next(n for n in range(first + 1, len(self.output_ids) + 1) if self._stop_at(self.decode(self.output_ids[:n])) >= 0)
            dropped = len(self.output_ids) - n
            del self.output_ids[n:]
            if self.logprobs is not None:
                del self.logprobs[n:]
            if dropped:
                del self.tokens[-dropped:]
            full = full[:cut]
            self.finish_reason = "stop"
        end = len(full)
        if not self.finished:
            if full.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
                end = len(full.rstrip("\ufffd"))
            for s in stops:  # hold back a tail that may turn out to start a stop string
                for n in range(min(len(s) - 1, end), 0, -1):
                    if full[:end].endswith(s[:n]):
                        end -= n
                        break
        end = max(end, len(self.text))
        delta, self.text = full[len(self.text) : end], full[:end]
        return delta
