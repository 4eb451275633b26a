"""OpenAI-compatible request bodies and error responses."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


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


class _Sampling(BaseModel):
    # unknown fields (logprobs, user, ...) are accepted and ignored, as vLLM does
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


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(..., description="A single prompt: text or token ids.")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
