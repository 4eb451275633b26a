"""OpenAI-compatible request bodies and error responses."""
from __future__ import annotations

import itertools
import time
import uuid
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from specdec.sampling import MAX_LOGPROBS


class APIError(Exception):
    """Raised anywhere in a request; rendered as OpenAI's error body with the given status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI / vLLM fields this server does not implement, with the values that ask for nothing
# (clients such as LangChain send them at their defaults): any other value is a 400 naming the
# field, never silently different output
UNSUPPORTED = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
               "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
               "response_format": ({"type": "text"},), "best_of": (1,), "suffix": ("",),
               "min_tokens": (0,), "prompt_logprobs": (0,)}


class _Sampling(BaseModel):
    # unknown fields (user, metadata, ...) are accepted and ignored, as vLLM does; known ones
    # this server does not implement are refused unless at a value that asks for nothing
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1, description="Most new tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="Extension: keep the k most likely tokens; 0 or -1 = all.")
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    num_speculative_tokens: int | None = Field(None, ge=0, le=16, description="Extension: K for this request; 0 = off.")
    proposer: Literal["draft", "ngram", "none"] | None = Field(None, description="Extension: which proposer drafts.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past end-of-sequence.")

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value is not None and value not in UNSUPPORTED[name]:
                raise APIError(400, f"{name}={value!r} is not supported by this server", param=name,
                               code="unsupported_parameter")

    def stops(self) -> list[str]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not x for x in s):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        if len(s) > 4:
            raise APIError(400, "at most 4 stop sequences are allowed", param="stop")
        return s


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="Return each output token's log-probability under the verifier.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="... and this many likeliest alternatives.")

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "logprobs must be true when top_logprobs is set", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="Text or token ids, or a list of them (one choice each; streamed only if one).")
    max_tokens: int | None = Field(None, ge=0, description="Most new tokens to generate; 0 with echo: score the prompt.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="Each output token's log-probability and this many likeliest alternatives.")
    echo: bool = Field(False, description="Return the prompt before the completion (with its logprobs if asked).")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)


def _clamped(lp: float) -> float:
    return max(lp, -9999.0)  # JSON has no -inf (vLLM clamps the same way)


def chat_logprobs(lps, token_text) -> dict:
    """A choice's `logprobs` in the chat API's shape, from specdec TokenLogprobs."""
    def entry(tid: int, lp: float) -> dict:
        t = token_text(tid)
        return {"token": t, "logprob": _clamped(lp), "bytes": list(t.encode("utf-8"))}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(i, v) for i, v in x.top]} for x in lps]}


def completion_logprobs(token_ids: list[int], lps: list, token_text, offset: int = 0) -> dict:
    """A choice's `logprobs` in the legacy completions shape. lps[j]: token_ids[j]'s TokenLogprob,
    or None where there is none (an echoed prompt's first token); offset: characters of output
    before these tokens (a stream's earlier chunks). As vLLM does, each position's alternatives
    include the token itself."""
    tokens = [token_text(t) for t in token_ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))[: len(tokens)]  # linear in a long prompt
    top = [None if x is None else {token_text(i): _clamped(v) for i, v in x.top + [(x.token_id, x.logprob)]}
           for x in lps]
    return {"tokens": tokens, "token_logprobs": [None if x is None else _clamped(x.logprob) for x in lps],
            "top_logprobs": top, "text_offset": offsets}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
