"""Application arguments (the `args:` of serve_config.yaml), validated by pydantic."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_name: str = Field("SmolLM2-135M-Instruct", description="Model id clients send as `model`; listed by /v1/models.")
    verifier: str = Field("default", description="Verifier model: 'default' (embedded SmolLM2), 'tiny[:opts]', an HF dir or a .gguf.")
    draft: str = Field("default", description="Draft for the Drafter: 'default' (shipped head), 'tiny[:opts]', a model path, or 'none'.")
    num_speculative_tokens: int = Field(4, ge=0, le=16, description="Default K per round; requests may lower or raise it up to max_speculative_tokens.")
    max_speculative_tokens: int = Field(8, ge=0, le=16, description="Largest K a request may ask for.")
    adaptive: bool = Field(True, description="Choose K each round from measured acceptance, load and cost (0 when speculation does not pay).")
    adaptive_options: dict[str, float | int | bool] = Field(default_factory=dict, description="Overrides of adaptive K's settings (fields of specdec.adaptive.AdaptiveK, e.g. min_gain, first_probe_k, slow_start, probe_min_room).")
    default_proposer: str = Field("draft", description="Proposer used when a request names none: 'draft', 'ngram' or 'none'.")
    lookup_min_n: int = Field(3, ge=0, le=16, description="Before the draft, try prompt lookup in the ingress: a suffix match of at least this many tokens drafts for free, with no Drafter call (0 = off).")
    prefetch_drafts: bool = Field(False, description="The Verifier gets each round's drafts from the Drafter itself and has the next round's drafted right after its pass: a speculative round is one remote call for the ingress, and drafting overlaps the result's trip back (the drafts are the same as drafting afterwards). Off by default: on a 2-core CPU, adaptive K then drafted more rounds that did not pay, and drafts made for a round that decodes plainly cost CPU (docs/serve-load-log.md, session 10).")
    transport: Literal["grpc", "actor"] = Field("grpc", description="How calls to the model replicas travel: 'grpc' sends those under 1 MB by value over Serve's gRPC transport (a round's call ~2 ms cheaper here, bench/calls.py) and bigger ones (sampled drafts' q rows) by reference; 'actor' sends every call by reference through Ray's object store (Serve's default).")
    device: str = Field("cpu", description="Torch device of the model replicas: 'cpu', 'cuda' or 'auto'.")
    dtype: str = Field("float32", description="Weights dtype: 'float32', 'bfloat16' or 'float16'.")
    num_threads: int = Field(0, ge=0, description="torch CPU threads per Verifier replica (0 = torch default).")
    draft_num_threads: int = Field(1, ge=0, description="torch CPU threads per Drafter replica (0 = torch default); with draft prefetch "
                                   "the Drafter runs while the Verifier waits for its drafts, so on a CPU they share it may use every core.")
    draft_nice: int = Field(19, ge=0, le=19, description="Niceness added to the Drafter's compute threads. A drafting round's drafts are made while the Verifier is idle, waiting for them, so they lose nothing; drafts made ahead for a round that then decodes plainly are wasted, and at low priority they no longer slow the Verifier's pass on a CPU both share (Ray starts workers at niceness 15 unless RAY_worker_niceness says otherwise; deployments/ray_env.py sets it to 0).")
    max_model_len: int = Field(2048, ge=16, description="Context window: prompt + completion tokens.")
    max_seqs: int = Field(32, ge=1, description="KV-cache slots per model replica; least recently used sequences are evicted beyond it.")
    prefix_caching: bool = Field(True, description="A new sequence starts from the longest prefix it shares with a cached one (a freed slot's, or a live one's, copied): the chat template's system prompt and a chat's history are not recomputed.")
    decode_steps: int = Field(4, ge=1, le=32, description="Plain decoding steps per Verifier call in rounds without drafts (multi-step scheduling: one call's overhead per several tokens, at the cost of coarser joins and stream chunks).")
    prefill_steps: int = Field(1, ge=1, le=32, description="At most this many plain decoding steps in a round that prefills a new prompt: a call streams nothing until it returns, so 1 sends a new request's first token right after its prefill (time to first token) and decode_steps there saves one call per new request.")
    decode_ahead: bool = Field(False, description="Pipelined multi-step decoding: right after a plain call's steps, the Verifier decodes the sequence's next decode_steps while the result travels back, and the next call takes them done (same tokens as decoding on demand). Meant for a GPU verifier, which idles during the round trip; off by default because on a 2-core CPU the round trip is CPU work that then competes with the pass (no gain measured).")
    max_batch_size: int = Field(16, ge=1, description="Sequences per verifier pass.")
    max_queue: int = Field(64, ge=1, description="Requests in flight per ingress replica before new ones get 429.")
    num_shards: int = Field(1, ge=1, description="Sequence groups per ingress; each group sticks to one drafter and one verifier replica.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none (capped by the context left).")
    request_timeout_s: float = Field(300.0, gt=0, description="A request still running after this long ends with a timeout error.")
    drafter_timeout_s: float = Field(5.0, gt=0, description="A drafter call slower than this is abandoned; the round runs with K=0.")
    verifier_retry_s: float = Field(30.0, ge=0, description="How long a failed verifier call is retried (on any replica) before its requests get 503.")
    api_keys_env: str | None = Field("SPECDEC_API_KEYS", description="Environment variable with comma-separated API keys; unset or empty = no auth.")
    api_keys_file: str | None = Field(None, description="File with one API key per line (added to those from api_keys_env).")
    rate_limit: str | None = Field(None, description="Per-key rate limit in `limits` notation, e.g. '60/minute'; None = unlimited.")

    @field_validator("adaptive_options")
    @classmethod
    def _known_adaptive_options(cls, v: dict) -> dict:
        import dataclasses

        from specdec.adaptive import AdaptiveK

        known = {f.name for f in dataclasses.fields(AdaptiveK) if f.init and not f.name.startswith("_")} - {"k_max", "draft_cost", "multi_step"}  # multi_step: from decode_steps
        if unknown := sorted(set(v) - known):
            raise ValueError(f"unknown adaptive option(s) {unknown}; known: {sorted(known)}")
        return v

    @classmethod
    def from_yaml(cls, path: str | Path, app: int = 0) -> "AppArgs":
        """The args of one application in a Serve config file."""
        cfg = yaml.safe_load(Path(path).read_text())
        return cls(**(cfg["applications"][app].get("args") or {}))
