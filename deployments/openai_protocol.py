"""OpenAI-compatible request and response bodies and error responses (the response models
document the API in /openapi.json; the routes build plain dicts of the same shape)."""
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
        # a message may quote the request's text, which may hold lone surrogates: the JSON body is
        # UTF-8, where they cannot be encoded (and rendering the error would itself fail)
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def check_text(value: str, param: str) -> None:
    """400 naming `param` when `value` cannot be UTF-8 (a lone surrogate, which JSON's \\uXXXX
    escapes can carry): the tokenizer would fail on it deep inside the request."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param} is not valid text: a lone surrogate at character {exc.start}", param=param,
                       code="invalid_value") from None


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI / vLLM fields this server does not implement, with the values that ask for nothing
# (clients such as LangChain send them at their defaults): any other value is a 400 naming the
# field, never silently different output. Fields named nowhere (user, metadata, store, ...) do
# not change what is generated and are accepted, as vLLM and OpenAI accept them.
UNSUPPORTED = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
               "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
               "response_format": ({"type": "text"},), "best_of": (1,), "suffix": ("",),
               "min_tokens": (0,), "prompt_logprobs": (0,), "min_p": (0,), "length_penalty": (1,),
               "use_beam_search": (False,), "bad_words": ([],), "allowed_token_ids": (),
               "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
               "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (), "modalities": (["text"],),
               "audio": (), "reasoning_effort": (), "web_search_options": (), "guided_json": (), "guided_regex": (),
               "guided_choice": (), "guided_grammar": (), "structured_outputs": (), "echo": (False,),
               "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
               "chat_template_kwargs": ({},), "return_tokens_as_token_ids": (False,)}


class _Sampling(BaseModel):
    # unknown fields (user, metadata, ...) are accepted and ignored, as vLLM does; known ones
    # this server does not implement are refused unless at a value that asks for nothing
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=1, description="Most new tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="Extension: keep the k most likely tokens; 0 or -1 = all.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    num_speculative_tokens: int | None = Field(None, ge=0, le=16, description="Extension: K for this request; 0 = off.")
    proposer: Literal["draft", "ngram", "none"] | None = Field(None, description="Extension: which proposer drafts.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past end-of-sequence.")
    stop_token_ids: list[int] | None = Field(None, description="Extension: token ids that end the output, as EOS does.")

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
        for x in s:
            check_text(x, "stop")
        return s


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are accepted (see check_supported)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (a file being edited)."""

    type: Literal["content"] = Field(..., description="Only `content` predictions exist.")
    content: str | list[ContentPart] = Field(..., description="The expected output, as text or text parts.")

    def text(self) -> str:
        """The prediction's text; 400 for a part that is not text."""
        parts = [ContentPart(type="text", text=self.content)] if isinstance(self.content, str) else self.content
        for j, part in enumerate(parts):
            if part.type != "text" or part.text is None:
                raise APIError(400, "a prediction's content parts must be text parts",
                               param=f"prediction.content.{j}", code="unsupported_content")
            check_text(part.text, "prediction.content")
        return "".join(p.text for p in parts)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content)
        return self.content or ""

    def check(self, i: int) -> None:
        """400 for a part the model cannot read (an image, audio, a file): answering the text alone
        would silently drop part of the question."""
        for j, part in enumerate(self.content if isinstance(self.content, list) else []):
            where = f"messages.{i}.content.{j}"
            if part.type != "text":
                raise APIError(400, f"content part type {part.type!r} is not supported: this model reads text only",
                               param=f"{where}.type", code="unsupported_content")
            if part.text is None:
                raise APIError(400, "a text content part needs `text`", param=f"{where}.text")
            check_text(part.text, f"{where}.text")
        if isinstance(self.content, str):
            check_text(self.content, f"messages.{i}.content")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="Return each output token's log-probability under the verifier.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="... and this many likeliest alternatives.")
    prediction: Prediction | None = Field(
        None, description="Text the output is expected to repeat: its tokens are verified as drafts, output unchanged.")

    def check_supported(self) -> None:
        super().check_supported()
        for i, m in enumerate(self.messages):
            m.check(i)

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
    prediction: Prediction | None = Field(
        None, description="Text the output is expected to repeat: its tokens are verified as drafts, output unchanged.")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)


# -- responses (documentation: the routes send dicts of these shapes) ---------------------------
FinishReason = Literal["stop", "length"]


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(..., description="invalid_request_error, not_found_error, rate_limit_error, timeout or server_error.")
    param: str | None = Field(..., description="The request field at fault (dotted path), or null.")
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, whatever its status (also sent as a stream's last event when a streamed request fails)."""

    error: ErrorDetail


class SpeculativeUsage(BaseModel):
    """Extension: what speculation did for the request (more fields than these may follow)."""

    model_config = ConfigDict(extra="allow")
    num_output_tokens: int
    num_drafted: int
    num_accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    num_verifier_passes: int


class CompletionTokensDetails(BaseModel):
    """As OpenAI reports Predicted Outputs: the prediction's tokens verified as drafts, kept or refused."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails
    speculative: SpeculativeUsage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion (the stream ends with `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    """A completion, or one `data:` event of a streamed one (then `usage` only on the last, if asked)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "starting"] = Field(..., description="ok (200): requests can be served; starting (503): "
                                              "no Verifier replica answers yet (or any more).")
    verifier: Literal["ok", "unavailable"]
    drafter: Literal["ok", "unavailable", "none"] = Field(
        ..., description="unavailable: requests are served without drafts until a Drafter answers again.")
    in_flight: int


def _sse_doc(chunk: type[BaseModel]) -> dict:
    """A stream's events: each `data` is a chunk's JSON, an ErrorResponse's (a request that fails
    mid-stream), or the closing `[DONE]` (the schema describes one event, as before Open API 3.2)."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"}, {"$ref": "#/components/schemas/ErrorResponse"}]}
    data = {"anyOf": [{"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
                      {"const": "[DONE]"}]}
    return {"schema": {"type": "object", "required": ["data"], "properties": {"data": data}}}


# models the event-stream schemas name, which the routes' own models do not bring into the schema
STREAM_MODELS = (ChatCompletionChunk, Completion, ErrorResponse)


_ERRORS = {400: "Invalid request: the parameter named in `error.param`", 401: "Missing or invalid API key",
           404: "Unknown model", 408: "The request ran past its timeout", 429: "Rate limit or queue full (see Retry-After)",
           500: "Internal error", 503: "The model replicas are unavailable (see Retry-After)"}


def error_responses(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


GENERATE_ERRORS = error_responses(400, 401, 404, 408, 429, 500, 503)
CHAT_RESPONSES = {200: {"model": ChatCompletion, "description": "The completion, or with `stream` an event stream",
                        "content": {"text/event-stream": _sse_doc(ChatCompletionChunk)}}, **GENERATE_ERRORS}
COMPLETION_RESPONSES = {200: {"model": Completion, "description": "The completion, or with `stream` an event stream",
                              "content": {"text/event-stream": _sse_doc(Completion)}}, **GENERATE_ERRORS}


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
