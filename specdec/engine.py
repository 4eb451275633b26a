"""The single-process engine: draft + verifier in one process, continuous batching of rounds.

One round (`step`) for every active sequence: one batched propose, one batched verifier pass,
then each sequence commits what was accepted. Sequences join and leave between rounds."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from specdec.config import EngineConfig
from specdec.metrics import SpecMetrics, aggregate
from specdec.models.runner import ModelRunner
from specdec.adaptive import AdaptiveK
from specdec.protocol import TokenLogprob
from specdec.proposers import DraftModelProposer, NgramProposer, Proposer, lookup_proposer
from specdec.rounds import Round, timed
from specdec.sampling import SamplingParams
from specdec.sequence import Delta, Sequence
from specdec.tokenizer import TextTokenizer
from specdec.verifier import Verifier


@dataclass
class Completion:
    seq_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: SpecMetrics
    logprobs: list[TokenLogprob] | None = None  # [len(token_ids)] when SamplingParams.logprobs was set

    def to_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "metrics": self.metrics.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [{"token_id": t.token_id, "logprob": t.logprob, "top": t.top} for t in self.logprobs]
        return out


def build_proposer(spec: str, cfg: EngineConfig, verifier_model=None) -> Proposer | None:
    """'none' -> None, 'ngram' -> prompt lookup, 'default' or a draft-head dir -> the EAGLE-style
    head on the verifier's features, anything else -> a standalone draft model by spec."""
    if spec == "none":
        return None
    if spec == "ngram":
        return NgramProposer(max_n=cfg.ngram_max)
    from specdec.models.loader import load_model

    head = head_dir(spec)
    if head is not None:
        from specdec.proposers.feature_head import FeatureHeadProposer

        # the head reuses the verifier's embedding, final norm and LM head rows
        verifier_model = verifier_model or load_model(cfg.verifier, cfg.device, cfg.dtype, cfg.progress, cfg.enforce_eager)
        return FeatureHeadProposer.from_pretrained(head, verifier_model, cfg.draft_tree_width)
    from specdec.models.pairing import check_pair

    vocab = check_pair(spec, cfg.verifier, cfg.progress)  # the verifier's tokenizer, or a clear error
    model = load_model(spec, cfg.device, cfg.dtype, cfg.progress, cfg.enforce_eager)
    model.pad_vocab(vocab)
    return DraftModelProposer(ModelRunner(model, cfg.max_seqs, cfg.max_model_len, prefix_caching=cfg.prefix_caching))


def is_head_dir(spec: str) -> bool:
    from pathlib import Path

    from specdec.models.draft_head import WEIGHTS

    return (Path(spec).expanduser() / WEIGHTS).exists()


def head_dir(spec: str):
    """Where the draft head named by `spec` lives ('default': the shipped one), or None when
    `spec` is not a draft head."""
    from pathlib import Path

    from specdec.proposers.feature_head import shipped_head_dir

    if spec == "default":
        return shipped_head_dir()
    return Path(spec).expanduser() if is_head_dir(spec) else None


def head_feature_layers(spec: str) -> tuple[int, ...]:
    """The verifier layers the draft `spec` reads besides the last (a fused-feature head's)."""
    from specdec.models.draft_head import DraftHead

    head = head_dir(spec)
    return DraftHead.feature_layers_of(head) if head is not None else ()


def build_verifier(cfg: EngineConfig) -> Verifier:
    from specdec.models.loader import load_model

    model = load_model(cfg.verifier, cfg.device, cfg.dtype, cfg.progress, cfg.enforce_eager)
    model.feature_layers = head_feature_layers(cfg.draft)  # before the first pass is compiled
    runner = ModelRunner(model, cfg.max_seqs, cfg.max_model_len, prefix_caching=cfg.prefix_caching)
    runner.warm_up()
    return Verifier(runner)


class SpecEngine:
    def __init__(self, verifier: Verifier, proposer: Proposer | None, tokenizer: TextTokenizer | None,
                 cfg: EngineConfig | None = None, extra_proposers: dict[str, Proposer] | None = None):
        self.cfg = cfg or EngineConfig()
        self.verifier = verifier
        self.proposers: dict[str, Proposer] = dict(extra_proposers or {})
        if proposer is not None:
            self.proposers.setdefault(proposer.name, proposer)
        self.default_proposer = proposer.name if proposer is not None else None
        self.tokenizer = tokenizer
        self.max_len = verifier.runner.max_len
        self.active: list[Sequence] = []
        self._proposer_of: dict[str, str | None] = {}
        self._ids = itertools.count()
        self.adaptive = AdaptiveK(k_max=max(self.cfg.num_speculative_tokens, 1)) if self.cfg.adaptive else None
        if self.adaptive is not None:
            self.adaptive.costs.local_drafts()  # every proposer here runs in this process
        self.lookup = lookup_proposer(self.cfg.lookup_min_n, self.cfg.ngram_max)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "SpecEngine":
        from specdec.models.loader import load_tokenizer

        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        verifier = build_verifier(cfg)
        if cfg.tune_layouts:
            from specdec.models.layouts import maybe_tune

            maybe_tune(verifier.runner.model)
        proposer = build_proposer(cfg.draft, cfg, verifier.runner.model)
        extra = {} if cfg.draft == "ngram" else {"ngram": NgramProposer(max_n=cfg.ngram_max)}
        return cls(verifier, proposer, TextTokenizer(load_tokenizer(cfg.verifier, cfg.progress)), cfg, extra)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
                    num_speculative_tokens: int | None = None, proposer: str | None = None,
                    seq_id: str | None = None, prediction: str | list[int] | None = None) -> Sequence:
        """prediction: text (or token ids) the output is expected to repeat, as OpenAI's Predicted
        Outputs: copied as drafts where the output meets it, even without a proposer; the output
        is the same with or without it."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif prompt and isinstance(prompt[0], dict):
            ids = self.tokenizer.chat(prompt)
        else:
            ids = list(prompt)
        k = self.cfg.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        name = proposer or self.default_proposer
        if name is not None and name not in self.proposers:
            raise ValueError(f"unknown proposer {name!r}; available: {sorted(self.proposers)}")
        predicted = self.tokenizer.encode(prediction) if isinstance(prediction, str) else list(prediction or [])
        seq = Sequence(seq_id or f"seq-{next(self._ids)}", ids, params, k if name or predicted else 0, self.max_len,
                       self.tokenizer.eos_token_ids if self.tokenizer else set(),
                       self.tokenizer.decode if self.tokenizer else None, prediction=predicted)
        self._proposer_of[seq.seq_id] = name
        self.active.append(seq)
        return seq

    def abort(self, seq_id: str) -> None:
        self.active = [s for s in self.active if s.seq_id != seq_id]
        self._release(seq_id)

    def _release(self, seq_id: str) -> None:
        self.verifier.free(seq_id)
        name = self._proposer_of.pop(seq_id, None)
        if name:
            self.proposers[name].free(seq_id)

    # -- rounds ------------------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, Delta]]:
        batch = self.active[: self.cfg.max_batch_size]
        if not batch:
            return []
        rnd = Round(batch, self._proposer_of, self.adaptive, self.lookup)
        for name, (idx, reqs) in rnd.propose_requests().items():
            props, secs = timed(self.proposers[name].propose, reqs)
            rnd.set_proposals(idx, props, secs)
        results, secs = timed(self.verifier.verify, rnd.verify_requests())
        out = rnd.commit(results, secs)
        for s, _ in out:
            if s.finished:
                self.active.remove(s)
                self._release(s.seq_id)
        return out

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None,
                 num_speculative_tokens: int | None = None, proposer: str | None = None,
                 predictions: list | None = None) -> list[Completion]:
        """Run prompts to completion, batched; returns completions in prompt order. predictions:
        one per prompt (add_request's prediction)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        preds = predictions or [None] * len(prompts)
        seqs = [self.add_request(p, sp, num_speculative_tokens, proposer, prediction=x)
                for p, sp, x in zip(prompts, plist, preds)]
        while any(not s.finished for s in seqs):
            self.step()
        return [completion(s) for s in seqs]

    def stats(self) -> dict:
        bs = list(self.verifier.batch_sizes)
        return {"verifier_passes": self.verifier.passes,
                "mean_batch_size": sum(bs) / len(bs) if bs else 0.0, "max_batch_size": max(bs, default=0)}


def completion(s: Sequence) -> Completion:
    return Completion(s.seq_id, s.text, list(s.output_ids), s.finish_reason, s.metrics,
                      None if s.logprobs is None else list(s.logprobs))


def summarize(completions: list[Completion]) -> dict:
    return aggregate([c.metrics for c in completions])
