"""The OpenAI-compatible HTTP ingress (no `from __future__ import annotations` here: FastAPI must see
real types in route signatures): /v1/chat/completions, /v1/completions, /v1/models,
/health and /metrics. It validates, authenticates and rate-limits, then hands sequences to the
round loop, which batches all users into shared drafter and verifier calls."""

import asyncio
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.metrics import aggregate
from specdec.sequence import Sequence

from deployments.config import AppArgs
from deployments.driver import Entry, RoundLoop
from deployments.metrics import RequestTracker, ServeMetrics
from deployments.openai_protocol import (CHAT_RESPONSES, COMPLETION_RESPONSES, STREAM_MODELS, APIError,
                                         ChatCompletionRequest, CompletionRequest, Health, ModelList, chat_logprobs,
                                         check_text, completion_logprobs, error_responses, new_id, now)

log = logging.getLogger("ray.serve")
app = FastAPI(title="specdec", description="Speculative decoding with an OpenAI-compatible API")


def _error(request: Request, err: APIError) -> Response:
    """Every error response goes out here: counted, and server errors logged with the request id."""
    if ServeMetrics.current is not None:
        ServeMetrics.current.observe_error(err.status, err.code)
    if err.status >= 500:
        log.warning("request %s failed: %s %s", _request_id(request), err.status, err.message)
    return err.response()


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError):
    return _error(request, exc)


# pydantic names union members and wrappers in an error's location (prompt.list[int].0,
# messages.0.content.str): they are not fields, so the path the client wrote stops before them
_NOT_FIELDS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-before"}


def _field_path(loc) -> str | None:
    path = []
    for x in loc[1:] if loc and loc[0] == "body" else ():
        if isinstance(x, str) and (x in _NOT_FIELDS or not x.replace("_", "a").isalnum()):
            break
        path.append(str(x))
    return ".".join(path) or None


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    # OpenAI answers malformed parameters with 400 and names the offending one; a body that is not
    # JSON names none (its error's location is a byte offset, no field)
    err = exc.errors()[0] if exc.errors() else {}
    if err.get("type") == "json_invalid":
        where = (err.get("ctx") or {}).get("error", "")
        return _error(request, APIError(400, f"the body is not valid JSON: {where}".rstrip(": "), code="invalid_json"))
    param = _field_path(err.get("loc", ()))
    return _error(request, APIError(400, f"{param or 'body'}: {err.get('msg', 'invalid request')}", param=param,
                                    code="invalid_value"))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(request, APIError(exc.status_code, str(exc.detail), kind, headers=exc.headers))


def _request_id(request_or_scope) -> str:
    scope = request_or_scope if isinstance(request_or_scope, dict) else request_or_scope.scope
    return scope.get("state", {}).get("request_id", "-")


class RequestIds:
    """Gives every request an id (the x-request-id response header, and the log lines of its
    errors), and turns an exception no handler took into an OpenAI-shaped 500: Starlette's own
    answer is a plain-text "Internal Server Error"."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = new_id("req")
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s: unhandled error", rid)
            if started:  # a stream already under way: it ends here (its generator reports its own errors)
                return
            if ServeMetrics.current is not None:
                ServeMetrics.current.observe_error(500, "internal_error")
            err = APIError(500, f"internal server error (request id {rid})", "server_error", code="internal_error")
            await err.response()(scope, receive, send_with_id)


app.add_middleware(RequestIds)


def _openapi() -> dict:
    """The schema as served, less the 422 FastAPI documents for every route with a body: this
    server answers invalid parameters with OpenAI's 400 (ErrorResponse), documented per route."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for model in STREAM_MODELS:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
            for name, sub in js.pop("$defs", {}).items():
                components.setdefault(name, sub)
            components.setdefault(model.__name__, js)
        app.openapi_schema = schema
    return app.openapi_schema


app.openapi = _openapi


def load_api_keys(args: AppArgs) -> list[bytes]:
    keys: list[str] = []
    if args.api_keys_env:
        keys += [k.strip() for k in os.environ.get(args.api_keys_env, "").split(",") if k.strip()]
    if args.api_keys_file:
        keys += [k.strip() for k in Path(args.api_keys_file).read_text().splitlines() if k.strip()]
    return [k.encode() for k in keys]


async def replicas_answer(handles, timeout_s: float) -> bool:
    """Whether one replica of each deployment answers a cheap call within timeout_s. A request
    sent while replicas still start waits for them (Serve queues it), but a load balancer asking
    /health must hear "not yet" until a request could be served."""
    try:
        await asyncio.wait_for(asyncio.gather(*(h.where.remote() for h in handles)), timeout_s)
        return True
    except Exception:  # still starting, restarting, or gone: all "not ready"
        return False


@dataclass
class Job:
    """One prompt of a request: its sequence and what the response adds around it."""

    seq: Sequence
    proposer: str | None
    echo: str | None = None  # completions' echo: the prompt's text, returned before the output
    generate: bool = True  # False: max_tokens 0 with echo, the prompt is only returned (and scored)
    prompt_logprobs: list | None = None  # with echo and logprobs: [None] + the prompt's TokenLogprobs
    tracker: RequestTracker | None = None  # its metrics, once admitted


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=256)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, args: dict, drafter, verifier):
        from limits import parse
        from limits.storage import MemoryStorage
        from limits.strategies import MovingWindowRateLimiter

        from specdec.adaptive import AdaptiveK
        from specdec.models.loader import load_tokenizer
        from specdec.tokenizer import TextTokenizer

        self.args = AppArgs(**args)
        self.tok = TextTokenizer(load_tokenizer(self.args.verifier, progress=False))
        self.keys = load_api_keys(self.args)
        self.limiter = MovingWindowRateLimiter(MemoryStorage()) if self.args.rate_limit else None
        self.limit = parse(self.args.rate_limit) if self.args.rate_limit else None
        adaptive = AdaptiveK(k_max=self.args.max_speculative_tokens, **self.args.adaptive_options) \
            if self.args.adaptive else None
        self.metrics = ServeMetrics(self.args.model_name)
        self.loop = RoundLoop(drafter, verifier, self.args, adaptive, self.metrics.observe_call)
        self.loop.observe_failure = self.metrics.observe_failure
        self.has_drafter = drafter is not None or self.args.draft_in_verifier  # a draft model or head
        self.verifier, self.drafter = verifier, drafter
        self.checked_at = -1e9  # when /health last asked the replicas
        self.up = {"verifier": False, "drafter": False}  # what they answered then
        self.stats_at = -1e9  # when /metrics last asked a Verifier replica for its cache figures
        self.created = now()

    # -- checks ------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> str:
        if not self.keys:
            return "anonymous"
        header = request.headers.get("authorization", "")
        given = header[7:].strip().encode() if header.lower().startswith("bearer ") else b""
        ok = False
        for k in self.keys:  # compare against every key, in constant time, whatever matches
            ok |= hmac.compare_digest(given, k)
        if not ok:
            raise APIError(401, "invalid or missing API key", "invalid_request_error", code="invalid_api_key")
        return "key-" + str(hash(given))  # a bucket name for rate limiting; the key itself is never logged

    def _admit(self, who: str, n: int = 1) -> None:
        if self.limiter is not None and not self.limiter.hit(self.limit, who):
            reset = self.limiter.get_window_stats(self.limit, who).reset_time
            raise APIError(429, f"rate limit of {self.args.rate_limit} exceeded", "rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(max(1, int(reset - time.time()) + 1))})
        if self.loop.in_flight + n > self.args.max_queue:
            raise APIError(429, "server busy: too many requests in flight", "rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"})

    def _check_model(self, model: str) -> None:
        if model != self.args.model_name:
            raise APIError(404, f"model {model!r} does not exist; available: {self.args.model_name!r}",
                           "invalid_request_error", param="model", code="model_not_found")

    def _sequence(self, req, prompt_ids: list[int], max_tokens: int | None, prompt_param: str):
        from specdec.sampling import SamplingParams
        from specdec.sequence import Sequence

        limit = self.args.max_model_len
        if len(prompt_ids) >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                           f"{len(prompt_ids)} tokens", param=prompt_param, code="context_length_exceeded")
        room = limit - len(prompt_ids)
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} exceeds the {room} tokens left in the {limit}-token "
                           f"context after a {len(prompt_ids)}-token prompt", param="max_tokens",
                           code="context_length_exceeded")
        proposer = req.proposer or self.args.default_proposer
        if proposer == "draft" and not self.has_drafter:
            proposer = "none" if req.proposer is None else None
            if proposer is None:
                raise APIError(400, "this deployment has no draft model", param="proposer")
        k = self.args.num_speculative_tokens if req.num_speculative_tokens is None else req.num_speculative_tokens
        if k > self.args.max_speculative_tokens:
            raise APIError(400, f"num_speculative_tokens must be <= {self.args.max_speculative_tokens}",
                           param="num_speculative_tokens")
        prediction = self._prediction(req)
        if proposer == "none" and not prediction:
            k = 0
        params = SamplingParams(max_tokens=max_tokens or min(self.args.default_max_tokens, room),
                                temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0), seed=req.seed,
                                stop=req.stops(), stop_token_ids=self._stop_ids(req), ignore_eos=req.ignore_eos,
                                logprobs=req.num_logprobs())
        seq = Sequence(new_id("seq"), prompt_ids, params, k, limit, self.tok.eos_token_ids, self.tok.decode,
                       prediction=prediction)
        return seq, (proposer if k > 0 and proposer != "none" else None)

    def _prediction(self, req) -> list[int]:
        """The prediction's tokens: at most a context's worth (the output cannot repeat more)."""
        if req.prediction is None:
            return []
        text = req.prediction.text()
        if len(text) > 16 * self.args.max_model_len:  # never tokenize a body's worth of text to refuse it
            raise APIError(400, f"the prediction is longer than the {self.args.max_model_len}-token context",
                           param="prediction.content")
        ids = self.tok.encode(text)
        if len(ids) > self.args.max_model_len:
            raise APIError(400, f"the prediction has {len(ids)} tokens, more than the {self.args.max_model_len}-token "
                           "context", param="prediction.content")
        return ids

    def _stop_ids(self, req) -> list[int]:
        ids = list(req.stop_token_ids or [])
        if any(not 0 <= t < len(self.tok.hf) for t in ids):
            raise APIError(400, "stop_token_ids contains ids outside the vocabulary", param="stop_token_ids")
        return ids

    # -- routes ------------------------------------------------------------------------------
    @app.get("/health", responses={200: {"model": Health, "description": "Requests can be served"},
                                   503: {"model": Health, "description": "No Verifier replica answers"},
                                   **error_responses(500)})
    async def health(self):
        """200 while requests can be served, which needs a Verifier: without a Drafter they are
        served without drafts (K=0), and the body says so."""
        # answers of the last few seconds stand: a load balancer polling /health must not add
        # calls to a 2-core machine's busy replicas (while no Verifier answers, each poll asks again)
        if time.monotonic() - self.checked_at > 5.0:
            drafter = replicas_answer([self.drafter], 2.0) if self.drafter is not None else asyncio.sleep(0, False)
            self.up["verifier"], self.up["drafter"] = await asyncio.gather(replicas_answer([self.verifier], 2.0), drafter)
            self.checked_at = time.monotonic() if self.up["verifier"] else -1e9
        ok = self.up["verifier"]
        body = {"status": "ok" if ok else "starting", "verifier": "ok" if ok else "unavailable",
                "drafter": "none" if self.drafter is None else "ok" if self.up["drafter"] else "unavailable",
                "in_flight": self.loop.in_flight}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition (vLLM's metric names, `specdec:` prefix)"},
                        **error_responses(500)})
    async def metrics(self):
        sizes = [len(es) for es in self.loop.shards.values()]
        batch = self.args.max_batch_size
        self.metrics.set_queue(sum(min(n, batch) for n in sizes), sum(max(0, n - batch) for n in sizes))
        await self._report_caches()
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def _report_caches(self) -> None:
        """The KV-cache figures of the Verifier replica that answers (at most every 5 s, as /health)."""
        if time.monotonic() - self.stats_at < 5.0:
            return
        self.stats_at = time.monotonic()
        try:
            s = await asyncio.wait_for(asyncio.ensure_future(self.verifier.cache_stats.remote()), 1.0)
        except Exception:  # busy or being replaced: its last figures stand
            return
        self.metrics.replicas.report(s.pop("replica"), s)

    @app.get("/v1/models", responses={200: {"model": ModelList}, **error_responses(401, 500)})
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.args.model_name, "object": "model", "created": self.created,
                                             "owned_by": "specdec", "max_model_len": self.args.max_model_len}]}

    @app.post("/v1/chat/completions", responses=CHAT_RESPONSES)
    async def chat(self, body: ChatCompletionRequest, request: Request):
        who = self._authorize(request)
        self._check_model(body.model)
        body.check_supported()
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            ids = self.tok.chat(messages)
        except Exception as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages")
        seq, proposer = self._sequence(body, ids, body.max_completion_tokens or body.max_tokens, "messages")
        self._admit(who)
        return await self._respond(body, [Job(seq, proposer)], chat=True)

    @app.post("/v1/completions", responses=COMPLETION_RESPONSES)
    async def completions(self, body: CompletionRequest, request: Request):
        who = self._authorize(request)
        self._check_model(body.model)
        body.check_supported()
        prompts = body.prompts()
        if body.stream and len(prompts) > 1:
            raise APIError(400, "a streamed request takes one prompt", param="prompt")
        if len(prompts) > self.args.max_queue:
            raise APIError(400, f"at most {self.args.max_queue} prompts per request", param="prompt")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo, to score the prompt)",
                           param="max_tokens")
        jobs = []
        for p in prompts:
            ids = list(p) if isinstance(p, list) else self._encode(p)
            if not ids:
                raise APIError(400, "prompt is empty", param="prompt")
            if any(not isinstance(t, int) or not 0 <= t < len(self.tok.hf) for t in ids):
                raise APIError(400, "prompt contains token ids outside the vocabulary", param="prompt")
            seq, proposer = self._sequence(body, ids, body.max_tokens or None, "prompt")
            echo = (p if isinstance(p, str) else self.tok.decode(ids)) if body.echo else None
            jobs.append(Job(seq, proposer, echo, generate=body.max_tokens != 0))
        self._admit(who, len(jobs))
        return await self._respond(body, jobs, chat=False)

    def _encode(self, text: str) -> list[int]:
        check_text(text, "prompt")
        try:
            return self.tok.encode(text)
        except Exception as exc:  # the tokenizer's own refusal: this prompt's fault, not the server's
            raise APIError(400, f"cannot tokenize the prompt: {exc}", param="prompt") from None

    # -- responses ---------------------------------------------------------------------------
    async def _respond(self, body, jobs: list[Job], chat: bool):
        rid = new_id("chatcmpl" if chat else "cmpl")
        for job in jobs:
            job.tracker = self.metrics.track(job.seq)
        if body.stream:
            [job] = jobs
            try:
                await self._score(job)  # before the stream starts, so that a failure is this response's status
            except BaseException as exc:
                job.tracker.end("abort" if isinstance(exc, asyncio.CancelledError) else "error")
                raise
            entry = self.loop.submit(job.seq, job.proposer, self.args.request_timeout_s) if job.generate else None
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(job, entry, rid, chat, include_usage), media_type="text/event-stream")
        tasks = [asyncio.ensure_future(self._run(job)) for job in jobs]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:  # one prompt failed or the client left: stop the others too
                t.cancel()
            raise
        seqs = [job.seq for job in jobs]
        usage = self._usage(seqs)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": now(), "model": self.args.model_name,
                             "choices": [self._choice(i, job, chat) for i, job in enumerate(jobs)], "usage": usage},
                            headers={"x-specdec-acceptance-rate": f"{usage['speculative']['acceptance_rate']:.4f}",
                                     "x-specdec-mean-accepted-length":
                                         f"{usage['speculative']['mean_accepted_length']:.4f}"})

    async def _run(self, job: Job) -> None:
        """Score the prompt if asked, then generate to the end."""
        try:
            await self._score(job)
            if job.generate:
                await self._generate(job)
        except BaseException as exc:
            job.tracker.end("abort" if isinstance(exc, asyncio.CancelledError) else "error")
            raise
        job.tracker.end(job.seq.finish_reason or "length")

    async def _generate(self, job: Job) -> None:
        entry = self.loop.submit(job.seq, job.proposer, self.args.request_timeout_s)
        try:
            while not (await self.loop.next_delta(entry)).finished:
                job.tracker.update()
        except BaseException:
            self.loop.abort(entry)
            raise

    async def _score(self, job: Job) -> None:
        """An echoed prompt's logprobs, when the request asks for logprobs."""
        if job.echo is None or job.seq.params.logprobs is None:
            return
        try:
            job.prompt_logprobs = [None] + await self.loop.prompt_logprobs(job.seq, job.seq.params.logprobs)
        except BaseException:
            self.loop.release(job.seq)
            raise
        if not job.generate:  # nothing will decode from the cached prompt
            self.loop.release(job.seq)

    def _choice(self, i: int, job: Job, chat: bool) -> dict:
        seq = job.seq
        if chat:
            return {"index": i, "message": {"role": "assistant", "content": seq.text},
                    "logprobs": self._logprobs(self._pairs(job, prompt=False), chat), "finish_reason": seq.finish_reason}
        return {"index": i, "text": (job.echo or "") + seq.text, "logprobs": self._logprobs(self._pairs(job), chat),
                "finish_reason": seq.finish_reason if job.generate else "length"}

    async def _stream(self, job: Job, entry: Entry | None, rid: str, chat: bool, include_usage: bool):
        seq = job.seq
        obj = "chat.completion.chunk" if chat else "text_completion"
        pending: list = []  # (token id, logprob) of tokens whose text is not out yet (half a character, a possible stop)
        offset = 0  # output characters streamed before this chunk (completions' text_offset)
        failed = None  # the APIError the stream ended with

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            nonlocal offset
            lps = None if first or seq.logprobs is None else self._logprobs(pending, chat, offset)
            pending.clear()
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": lps, "finish_reason": finish}
            offset += len(text or "")
            return _sse({"id": rid, "object": obj, "created": now(), "model": self.args.model_name, "choices": [choice]})

        try:
            if chat:
                yield chunk(None, None, first=True)
            if job.echo is not None:  # the prompt (and its logprobs) first
                pending += self._pairs(job, output=False) or []
                yield chunk(job.echo, None if job.generate else "length")
            while entry is not None:
                try:
                    d = await self.loop.next_delta(entry)
                except Exception as exc:  # the status went out with the first chunk: the error is the last event
                    failed = self._stream_error(exc, rid)
                    yield _sse(failed.body())
                    break
                job.tracker.update()
                pending += [(t.token_id, t) for t in d.logprobs or []]
                if d.text or d.finished:  # one chunk per accepted block
                    yield chunk(d.text, d.finish_reason if d.finished else None)
                if d.finished:
                    break
            if include_usage and (seq.finished or not job.generate):
                yield _sse({"id": rid, "object": obj, "created": now(), "model": self.args.model_name, "choices": [],
                            "usage": self._usage([seq])})
            yield "data: [DONE]\n\n"
        finally:
            if entry is not None and not seq.finished:  # failed, or the client left mid-stream: free its caches now
                self.loop.abort(entry)
            job.tracker.end("error" if failed else seq.finish_reason or ("length" if not job.generate else "abort"))

    def _stream_error(self, exc: Exception, rid: str) -> APIError:
        if not isinstance(exc, APIError):
            log.error("stream %s failed", rid, exc_info=exc)
            exc = APIError(500, f"internal server error ({rid})", "server_error", code="internal_error")
        self.metrics.observe_error(exc.status, exc.code)
        return exc

    @staticmethod
    def _pairs(job: Job, prompt: bool = True, output: bool = True) -> list | None:
        """(token id, TokenLogprob or None) for the echoed prompt and the output, None without logprobs."""
        seq = job.seq
        if seq.logprobs is None:
            return None
        pairs = list(zip(seq.prompt_ids, job.prompt_logprobs)) if prompt and job.prompt_logprobs is not None else []
        return pairs + [(t.token_id, t) for t in seq.logprobs] if output else pairs

    def _logprobs(self, pairs: list | None, chat: bool, offset: int = 0) -> dict | None:
        if pairs is None:
            return None
        if chat:
            return chat_logprobs([lp for _, lp in pairs], self.tok.token_text)
        return completion_logprobs([t for t, _ in pairs], [lp for _, lp in pairs], self.tok.token_text, offset)

    def _usage(self, seqs: list) -> dict:
        prompt, out = sum(len(s.prompt_ids) for s in seqs), sum(len(s.output_ids) for s in seqs)
        spec = seqs[0].metrics.to_dict() if len(seqs) == 1 else aggregate([s.metrics for s in seqs])
        drafted, kept = spec["num_prediction_drafted"], spec["num_prediction_accepted"]
        details = {"accepted_prediction_tokens": kept, "rejected_prediction_tokens": drafted - kept}
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
                "completion_tokens_details": details, "speculative": spec}

    # -- for tests and operators -------------------------------------------------------------
    async def loop_stats(self) -> dict:
        return {"in_flight": self.loop.in_flight, "rounds": self.loop.rounds,
                "drafter_failures": self.loop.drafter_failures, "verifier_failures": self.loop.verifier_failures,
                "recent_rounds": list(self.loop.trace),
                "adaptive": self.loop.adaptive.state() if self.loop.adaptive is not None else None}
