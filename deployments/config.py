"""Application arguments (the `args:` of serve_config.yaml): the engine's configuration plus what
only the Serve app needs, validated by pydantic, one line of description per field."""
from __future__ import annotations

import inspect
from pathlib import Path

import yaml
from pydantic import Field, field_validator, model_validator

from specdec.config import EngineConfig


class AppArgs(EngineConfig):
    model_name: str = Field("SmolLM2-135M-Instruct", description="Model id clients send as `model`; listed by /v1/models.")
    max_speculative_tokens: int = Field(8, ge=0, le=16, description="Largest K a request may ask for (num_speculative_tokens is the default).")
    adaptive_options: dict[str, float | int | bool] = Field(default_factory=dict, description="Overrides of adaptive K's settings (arguments of specdec.adaptive.AdaptiveK, e.g. min_gain, first_probe_k).")
    default_proposer: str = Field("draft", description="Proposer used when a request names none: 'draft' (the draft head in the Verifier, or the Drafter's draft model), 'ngram' or 'none'.")
    draft_num_threads: int = Field(1, ge=0, description="torch CPU threads per Drafter replica (0 = torch's default); a draft head has none, it runs in the Verifier.")
    decode_steps: int = Field(8, ge=1, le=32, description="Passes per Verifier call in rounds whose drafts, if any, the Verifier makes itself (plain steps, or its draft head's drafts verified): one call's overhead per several passes (streamed as one chunk).")
    prefill_steps: int = Field(1, ge=1, le=32, description="At most this many plain steps in a round that prefills a new prompt (1: its first token streams right after the prefill).")
    max_queue: int = Field(64, ge=1, description="Requests in flight per ingress replica before new ones get 429.")
    num_shards: int = Field(1, ge=1, description="Sequence groups per ingress; each group sticks to one Drafter and one Verifier replica.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none (capped by the context left).")
    request_timeout_s: float = Field(300.0, gt=0, description="A request still running after this long ends with a timeout error.")
    drafter_timeout_s: float = Field(5.0, gt=0, description="A Drafter call slower than this is abandoned; the round runs with K=0.")
    verifier_retry_s: float = Field(30.0, ge=0, description="How long a failed Verifier call is retried (on any replica) before its requests get 503.")
    api_keys_env: str | None = Field("SPECDEC_API_KEYS", description="Environment variable with comma-separated API keys; unset or empty = no auth.")
    api_keys_file: str | None = Field(None, description="File with one API key per line (added to those from api_keys_env).")
    rate_limit: str | None = Field(None, description="Per-key rate limit in `limits` notation, e.g. '60/minute'; None = unlimited.")

    @field_validator("adaptive_options")
    @classmethod
    def _known_adaptive_options(cls, v: dict) -> dict:
        from specdec.adaptive import AdaptiveK

        # k_max follows max_speculative_tokens; the rest are what AdaptiveK takes
        known = set(inspect.signature(AdaptiveK).parameters) - {"k_max"}
        known = {k for k in known if not k.startswith("_")}
        if unknown := sorted(set(v) - known):
            raise ValueError(f"unknown adaptive option(s) {unknown}; known: {sorted(known)}")
        return v

    @model_validator(mode="after")
    def _default_k_within_max(self) -> "AppArgs":
        if self.num_speculative_tokens > self.max_speculative_tokens:
            raise ValueError(f"num_speculative_tokens ({self.num_speculative_tokens}) exceeds "
                             f"max_speculative_tokens ({self.max_speculative_tokens})")
        return self

    @property
    def draft_in_verifier(self) -> bool:
        """The draft is a head on the verifier's features (EAGLE-style): it runs in the Verifier
        replicas, next to those features, and the app has no Drafter."""
        from specdec.engine import head_dir

        return self.draft != "none" and head_dir(self.draft) is not None

    def engine(self) -> EngineConfig:
        """The engine's part, for the model replicas (no progress bars in a replica's log)."""
        return EngineConfig(**self.model_dump(include=set(EngineConfig.model_fields)) | {"progress": False})

    @classmethod
    def from_yaml(cls, path: str | Path, app: int = 0) -> "AppArgs":
        """The args of one application in a Serve config file."""
        cfg = yaml.safe_load(Path(path).read_text())
        return cls(**(cfg["applications"][app].get("args") or {}))
