"""The OpenAI-compatible HTTP app: routes, streaming, errors.

Each generation request becomes a *group* of engine requests (one per prompt and choice) that the
engine thread runs with everything else (``async_engine.py``). A streaming response starts only
once the group's first output is there, so that a request that fails on its prompt pass still
gets a real status code (500) rather than a 200 followed by an error event; a failure later in a
stream is sent as an ``{"error": ...}`` event, which the openai client raises.

A client that goes away is noticed by Starlette's disconnect listener while streaming (the
generator is cancelled), and by polling ``Request.is_disconnected`` while a non-streaming request
waits; either way the group is aborted and its KV slots are freed at the next engine step.

Every refusal is counted in ``quickdraft:request_failure{reason}``; every accepted request ends in
a response, an error response, or an error event. A body is bounded (size, depth, Unicode, prompt
length: ``limits.py``) before any model work, and an unexpected error becomes a 500 with a request
id (``guard.py``); docs/serving-errors.md lists what a client sees.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quickdraft import __version__
from quickdraft.engine.scheduler import QueueFullError
from quickdraft.engine.sequence import RequestOutput, SpecStats
from quickdraft.errors import QuickdraftError
from quickdraft.sampling import SamplingParams
from quickdraft.server.async_engine import AsyncEngine, Group
from quickdraft.server.guard import CatchAll, internal_error, request_id
from quickdraft.server.limits import (DEFAULT_MAX_BODY_BYTES, HeaderLimit, PromptBound, ReturnMemory, check_counts,
                                     decode_body, read_body)
from quickdraft.server.metrics import CONTENT_TYPE
from quickdraft.server.protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body, openapi_body,
    parse_request,
)
from quickdraft.server.streaming import SSE_DONE, IncrementalText, sse
from quickdraft.server import tools as tooling
from quickdraft.structured import StructuredSpec

log = logging.getLogger("quickdraft.server")

_FAILURE_BY_STATUS = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "bad_request",
                      413: "bad_request", 422: "bad_request", 429: "queue_full", 503: "shutting_down"}


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    spec_method: str = "none"
    num_speculative_tokens: int = 0
    retry_after_s: int = 1  # the Retry-After of a 429
    disconnect_poll_s: float = 0.25  # how often a waiting non-streaming request checks its client
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body gets a 413
    draining: bool = False  # set on SIGTERM: new requests get a 503 while in-flight ones finish
    created: int = field(default_factory=lambda: int(time.time()))


class _ClientGone(Exception):
    pass


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop(timeout=30)

    app = FastAPI(title="quickdraft", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    api = _Api(engine, settings)
    _add_error_handlers(app, api)
    app.add_middleware(CatchAll, on_error=lambda: engine.metrics.failure("error"))
    app.add_middleware(HeaderLimit, on_refuse=lambda: engine.metrics.failure("bad_request"))
    app.add_middleware(ReturnMemory)  # outermost: after the response, errors included (limits.py)

    app.get("/health")(api.health)
    app.get("/version")(api.version)
    app.get("/metrics")(api.metrics_route)
    app.get("/v1/models")(api.models)
    app.get("/tokenizer_info")(api.tokenizer_info)
    app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))(api.tokenize)
    app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))(api.detokenize)
    app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))(api.completions)
    app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))(api.chat_completions)
    return app


def _add_error_handlers(app: FastAPI, api: "_Api") -> None:
    @app.exception_handler(QuickdraftError)
    async def _quickdraft_error(request: Request, exc: QuickdraftError):
        return api.refuse(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return api.refuse(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind))


def _json_error(status: int, message: str, error_type: str, param: str | None = None,
                code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, error_type, param, code), status_code=status, headers=headers)


class _Api:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        sched = engine.engine.scheduler
        self.capacity = sched.num_slots + sched.max_queue  # choices one request can ever hold
        self.prompt_bound = PromptBound(self.tokenizer, self.max_model_len)

    # -- errors -----------------------------------------------------------------------------
    def refuse(self, exc: QuickdraftError) -> JSONResponse:
        """A refused request: count it and answer in OpenAI's format."""
        status = exc.status_code
        self.engine.metrics.failure(_FAILURE_BY_STATUS.get(status, "error"))
        headers = dict(getattr(exc, "headers", {}) or {})
        if isinstance(exc, QueueFullError) or status == 429:
            headers.setdefault("Retry-After", str(self.settings.retry_after_s))
        code = getattr(exc, "code", None)
        return _json_error(status, exc.message, exc.error_type, exc.param, code, headers)

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "incorrect API key provided", "authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def _parse(self, request: Request, model):
        self._authorize(request)
        if self.settings.draining:
            raise APIError(503, "the server is shutting down; retry on another replica", "service_unavailable",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        body = await decode_body(await read_body(request, self.settings.max_body_bytes))
        check_counts(body, self.max_model_len, self.engine.engine.model.config.vocab_size)
        req = parse_request(model, body)
        optional = model in (TokenizeRequest, DetokenizeRequest)  # vLLM's tokenizer routes may leave it out
        if not (optional and req.model is None) and req.model not in self.settings.served_model_names:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves "
                           f"{', '.join(self.settings.served_model_names)}", "not_found_error",
                           param="model", code="model_not_found")
        return req

    # -- plain routes -----------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        snap = dict(self.engine.snapshot)
        if not self.engine.alive:
            return JSONResponse({"status": "error", **snap}, status_code=503)
        if self.settings.draining:
            return JSONResponse({"status": "draining", **snap}, status_code=503)
        return JSONResponse({"status": "ok", **snap})

    async def version(self) -> dict:
        """The version, and whether speculative output equals plain output bit for bit here (see
        quickdraft/kernels: true on quickdraft's CPU kernels, false on cuBLAS or the torch fallback), with
        the instruction set the CPU kernels run (``batch_invariance.kernels``)."""
        return {"version": __version__, "batch_invariance": self.engine.engine.decoder.batch_invariance.to_dict()}

    async def metrics_route(self) -> Response:
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> dict:
        self._authorize(request)
        s = self.settings
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": s.created, "owned_by": "quickdraft",
             "root": self.engine.engine.config.model, "max_model_len": self.max_model_len,
             "speculative": {"method": s.spec_method, "num_speculative_tokens": s.num_speculative_tokens}}
            for name in s.served_model_names]}

    def _check_ids(self, ids, what: str, param: str) -> None:
        """A 400 unless every id is one of the model's tokens."""
        vocab = self.engine.engine.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{what} must lie in [0, {vocab})", param=param)

    # -- the tokenizer (vLLM's routes: lm-evaluation-harness's remote tokenizer uses them) -----
    async def tokenizer_info(self, request: Request) -> dict:
        self._authorize(request)
        tok = self.tokenizer
        name = lambda i: None if i is None else tok.id_to_token(i)  # noqa: E731
        return {"tokenizer_class": "quickdraft", "eos_token": name(tok.eos_token_ids[0] if tok.eos_token_ids else None),
                "bos_token": name(tok.bos_token_id), "pad_token": None, "add_bos_token": tok.add_bos_token,
                "chat_template": tok.chat_template, "model_max_length": self.max_model_len}

    async def tokenize(self, request: Request) -> dict:
        req: TokenizeRequest = await self._parse(request, TokenizeRequest)
        # Bounded as a prompt is: a text that certainly holds more tokens than the context is refused
        # from its byte count. One that may fit is counted exactly, even past the context, since a
        # client may split it into windows (lm-evaluation-harness's rolling loglikelihood does).
        self.prompt_bound.check(req.prompt, "prompt")
        ids = self.tokenizer.encode(req.prompt)
        if req.add_special_tokens is False and self.tokenizer.add_bos_token and ids[:1] == [self.tokenizer.bos_token_id]:
            ids = ids[1:]
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize(self, request: Request) -> dict:
        req: DetokenizeRequest = await self._parse(request, DetokenizeRequest)
        self._check_ids(req.tokens, "token ids", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    # -- generation -------------------------------------------------------------------------
    async def completions(self, request: Request):
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        self._check_capacity(req, len(req.prompts()))  # before tokenizing them all
        prompts = []
        for p in req.prompts():
            if isinstance(p, list):
                self._check_ids(p, "prompt token ids", "prompt")
            else:
                self.prompt_bound.check(p, "prompt")
            prompts.append(self.tokenizer.encode(p) if isinstance(p, str) else p)
        return await self._generate(request, req, prompts, chat=False)

    async def chat_completions(self, request: Request):
        req: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        tooling.check_tools(req.tools, req.tool_choice)
        messages = [tooling.template_message(m.as_template_dict()) for m in req.messages]
        try:
            text = tooling.render(self.tokenizer, messages, tooling.active_tools(req.tools, req.tool_choice))
        except QuickdraftError:
            raise
        except Exception as e:  # a Jinja error in the model's own template, on these messages
            raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from None
        self.prompt_bound.check(text, "messages")
        return await self._generate(request, req, [self.tokenizer.encode(text)], chat=True)

    def _check_context(self, req, prompt_len: int, chat: bool) -> None:
        """vLLM's rule: a 400 unless the prompt leaves room to generate, and the prompt plus an
        explicit max_tokens fits the context (streamed or not, whatever the number's size)."""
        where = "messages" if chat else "prompt"
        if prompt_len >= self.max_model_len:
            raise APIError(400, f"the prompt has {prompt_len} tokens, but the context holds {self.max_model_len}: "
                           "no room is left to generate", param=where, code="context_length_exceeded")
        limit = req.token_limit if chat else req.max_tokens
        if limit is not None and prompt_len + limit > self.max_model_len:
            name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                           f"{prompt_len + limit} tokens ({prompt_len} in the {where}, {limit} in the completion). "
                           f"Reduce the length of the {where} or {name}", param=name, code="context_length_exceeded")

    async def _structured(self, req, chat: bool) -> StructuredSpec | None:
        """The request's grammar (response_format, structured_outputs, or a tool_choice to enforce),
        compiled here so that one that does not compile is a 400 (StructuredOutputError) before
        anything is queued; the engine then finds it in the cache. Off the event loop: the first
        one builds the grammar library's view of the vocabulary (0.3 s to 1 s)."""
        spec = req.structured_spec()
        forced = tooling.tool_spec(tooling.active_tools(req.tools, req.tool_choice), req.tool_choice,
                                    self.tokenizer) if chat else None
        if spec is not None and forced is not None:
            raise APIError(400, "a tool_choice that forces a call cannot be combined with response_format or "
                           "structured_outputs", param="tool_choice")
        spec = spec or forced
        grammars = self.engine.engine.grammars
        if spec is not None:
            if grammars is None:
                raise APIError(400, "structured outputs need the model's tokenizer, and this model has none",
                               param=spec.param)
            await asyncio.to_thread(grammars.compile, spec)
        return spec

    def _params(self, req, prompt: list[int], index: int, chat: bool,
                structured: StructuredSpec | None = None) -> SamplingParams:
        limit = req.token_limit if chat else req.max_tokens
        room = self.max_model_len - len(prompt)  # >= 1: _check_context refused the rest
        if limit is None:  # chat: up to the context; completions: OpenAI's default of 16, as room allows
            limit = room if chat else min(16, room)
        limit = max(1, limit)  # max_tokens 0 (echo only) still runs the prompt pass, whose output is dropped
        seed = None if req.seed is None else (req.seed + index) % 2**64  # choices differ, reproducibly
        return SamplingParams(
            max_tokens=limit, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0, seed=seed,
            stop=req.stop_list(), ignore_eos=bool(req.ignore_eos), num_speculative_tokens=req.speculation_cap,
            logprobs=req.logprob_count, prompt_logprobs=None if chat else req.prompt_logprob_count,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.bias(), min_tokens=min(req.min_tokens or 0, limit), structured=structured,
        )

    def _check_capacity(self, req, num_prompts: int) -> None:
        choices = (req.n or 1) * num_prompts
        if choices > self.capacity:
            raise APIError(400, f"{choices} choices exceed what this server can ever hold "
                           f"({self.capacity}: --max-num-seqs + --max-queue)", param="n")

    async def _generate(self, request: Request, req, prompts: list[list[int]], chat: bool):
        n = req.n or 1
        self._check_capacity(req, len(prompts))
        for p in prompts:
            self._check_context(req, len(p), chat)
        self._check_ids(req.bias(), "logit_bias keys must be token ids that", "logit_bias")
        structured = await self._structured(req, chat)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        ids, flat, params = [], [], []
        for p_index, prompt in enumerate(prompts):
            for i in range(n):
                ids.append(f"{rid}-{p_index * n + i}")
                flat.append(prompt)
                params.append(self._params(req, prompt, i, chat, structured))
        group = await self.engine.add(ids, flat, params)
        self.engine.metrics.admitted(sum(len(p) for p in prompts))
        reply = _Reply(rid, req.model, chat, sum(len(p) for p in prompts), self.settings, bool(req.return_token_ids),
                       req.speculation_cap, self.tokenizer, echo=not chat and bool(req.echo),
                       tools=chat and bool(tooling.active_tools(req.tools, req.tool_choice)),
                       prompt_only=not chat and req.max_tokens == 0)
        try:
            first = await self._next(group, request)
        except _ClientGone:
            self.engine.abort(group.request_ids)
            return Response(status_code=499)  # nobody reads it
        except BaseException:
            self.engine.abort(group.request_ids)
            raise
        if _failed(first[1]):
            self.engine.abort(group.request_ids)
            return reply.failure(first[1])
        if req.stream:
            stops = [p.stop for p in params]
            return StreamingResponse(self._stream(group, first, reply, stops, req.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._collect(request, group, first, reply)

    async def _next(self, group: Group, request: Request) -> tuple[int, RequestOutput]:
        """The group's next output; meanwhile, every ``disconnect_poll_s``, check that the client
        is still there (outputs may arrive faster than that, so the check is by the clock)."""
        poll = self.settings.disconnect_poll_s
        while True:
            now = time.monotonic()
            if now - group.last_disconnect_check >= poll:
                group.last_disconnect_check = now
                if await request.is_disconnected():
                    raise _ClientGone()
            try:
                item = await asyncio.wait_for(group.queue.get(), timeout=poll)
            except asyncio.TimeoutError:
                continue
            if item[1].finished:
                group.finished.add(item[0])
            return item

    async def _collect(self, request: Request, group: Group, first, reply: "_Reply"):
        final: dict[int, RequestOutput] = {}
        item = first
        try:
            while True:
                index, out = item[0], reply.view(item[1])
                if _failed(out):
                    return reply.failure(out)
                if out.finished:
                    final[index] = out
                if group.done:
                    break
                item = await self._next(group, request)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the finally below frees the slots
        finally:
            if not group.done:
                self.engine.abort([r for i, r in enumerate(group.request_ids) if i not in group.finished])
        return JSONResponse(reply.full([final[i] for i in range(len(group.request_ids))]))

    async def _stream(self, group: Group, first, reply: "_Reply", stops, include_usage: bool):
        texts = [IncrementalText(s + ((tooling.CALL_OPEN,) if reply.tools else ())) for s in stops]
        final: dict[int, RequestOutput] = {}
        try:
            if reply.chat:
                for i in range(len(group.request_ids)):
                    yield sse(reply.chunk(i, "", None, include_usage, role=True))
            item, echoed = first, set()
            while True:
                index, out = item[0], reply.view(item[1])
                if _failed(out):
                    yield sse(reply.failure_body(out))
                    return
                if reply.echo and index not in echoed:  # the prompt first, as the whole reply's text starts
                    echoed.add(index)
                    yield sse(reply.echo_chunk(out, index, include_usage))
                visible, calls = reply.split_calls(out)
                # with tools, the text up to a call is content; from <tool_call> on it is held back
                delta = texts[index].delta(visible, out.finished or visible != out.text)
                if out.finished:
                    final[index] = out
                if delta or out.finished or ((reply.token_ids or out.new_logprobs) and out.new_token_ids):
                    reason = ("tool_calls" if calls else out.finish_reason) if out.finished else None
                    yield sse(reply.chunk(index, delta, reason, include_usage, token_ids=out.new_token_ids,
                                          logprobs=reply.scored(out.new_logprobs, out), tool_calls=calls))
                if group.done:
                    break
                item = await group.queue.get()
                if item[1].finished:
                    group.finished.add(item[0])
            if include_usage:
                yield sse(reply.usage_chunk([final[i] for i in range(len(group.request_ids))]))
            yield SSE_DONE
        except Exception as exc:  # the status is sent: the error becomes the stream's last event
            rid = request_id()
            log.exception("unhandled error in a stream of %s (request id %s)", reply.id, rid)
            self.engine.metrics.failure("error")
            yield sse(internal_error(exc, rid))
        finally:
            # A disconnect cancels this generator; abort what is left so its KV slots free at once.
            if not group.done:
                self.engine.abort([r for i, r in enumerate(group.request_ids) if i not in group.finished])


def _failed(out: RequestOutput) -> bool:
    return out.finished and out.finish_reason in ("error", "abort")


@dataclass
class _Reply:
    """Builds the response bodies of one request."""

    id: str
    model: str
    chat: bool
    prompt_tokens: int
    settings: ServerSettings
    token_ids: bool = False  # return_token_ids: each choice (chunk) carries its (new) token ids
    speculation_cap: int | None = None  # the request's "speculative": {"num_speculative_tokens"}, if any
    tokenizer: Any = None  # renders the tokens of logprobs
    echo: bool = False  # completions' echo: each choice's text (and logprobs) starts with its prompt
    created: int = field(default_factory=lambda: int(time.time()))
    tools: bool = False  # chat with tools: the replies' tool calls become tool_calls (server/tools.py)
    prompt_only: bool = False  # max_tokens 0 with echo: the prompt pass's output is dropped
    _offsets: dict[int, int] = field(default_factory=dict)  # a streamed completion choice's text so far, for text_offset

    def view(self, out: RequestOutput) -> RequestOutput:
        """``out`` as this reply shows it: with ``prompt_only``, no output tokens (the engine
        generates at least one, which vLLM's max_tokens 0 leaves out), finishing on "length"."""
        if not self.prompt_only:
            return out
        reason = out.finish_reason if _failed(out) else ("length" if out.finished else None)
        empty = None if out.logprobs is None else []
        return dataclasses.replace(out, token_ids=[], new_token_ids=[], text="", logprobs=empty, new_logprobs=empty,
                                   eos_token_id=None, eos_logprob=None, finish_reason=reason)

    def scored(self, lps, out: RequestOutput):
        """A reply's logprobs, with the end of sequence's entry last where one stopped it: it was
        sampled and counted in completion_tokens, as vLLM returns it for both APIs, and clients
        scoring a continuation (lm-evaluation-harness's ``token_logprobs[ctxlen:-1]``) take the
        last entry to be the generated token's."""
        if lps is None or out.eos_logprob is None:
            return lps
        return [*lps, out.eos_logprob]

    def split_calls(self, out: RequestOutput) -> tuple[str, list[dict]]:
        """(the text to show as content so far, the tool calls of a finished reply). With tools,
        a running reply shows its text up to its first <tool_call>; a finished one, its content
        before the calls, or all of its text where no call parses."""
        if not self.tools:
            return out.text, []
        text = self.tool_text(out)
        if not out.finished:
            if text.lstrip().startswith("{"):  # perhaps a call without its tags: held to the end
                return "", []
            cut = text.find(tooling.CALL_OPEN)
            return (text if cut < 0 else text[:cut]), []
        content, calls = tooling.parse_tool_calls(text)
        if not calls:
            return text, []
        return content or "", calls

    def tool_text(self, out: RequestOutput) -> str:
        """The reply's text with its special tokens: Qwen's <tool_call> is one, which the
        engine's text (special tokens skipped) leaves out. The end of sequence is not in it."""
        return self.tokenizer.decode(out.token_ids, skip_special_tokens=False)

    def message(self, out: RequestOutput) -> tuple[dict, str | None]:
        """A finished chat choice's message and finish_reason ("tool_calls" where it called one)."""
        content, calls = tooling.parse_tool_calls(self.tool_text(out)) if self.tools else (out.text, [])
        if not calls:
            return {"role": "assistant", "content": out.text}, out.finish_reason
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def _token(self, token_id: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw

    def logprobs(self, lps, index: int = 0) -> dict | None:
        """OpenAI's logprobs object for these tokens (RequestOutput.logprobs), or None where the
        request asked for none: chat's {"content": [...]}, or the completions API's parallel lists
        (text_offset counts from the start of the choice's text, across a stream's chunks)."""
        if lps is None:
            return None
        if self.chat:
            def entry(token_id, logprob):
                text, raw = self._token(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(raw)}
            return {"content": [{**entry(t.token_id, t.logprob),
                                 "top_logprobs": [entry(i, lp) for i, lp in self._top_ids(t)]} for t in lps],
                    "refusal": None}
        tokens, offsets, at = [], [], self._offsets.get(index, 0)
        for t in lps:
            text = self._token(t.token_id)[0]
            tokens.append(text)
            offsets.append(at)
            at += len(text)
        self._offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
                "top_logprobs": [self._top(t) for t in lps], "text_offset": offsets}

    def _top(self, t) -> dict[str, float]:
        """The legacy completions' top_logprobs: the N most likely tokens and, as OpenAI and vLLM
        give it, the chosen token too (N + 1 entries where it is not among them)."""
        top = {self._token(i)[0]: lp for i, lp in t.top}
        top.setdefault(self._token(t.token_id)[0], t.logprob)
        return top

    @staticmethod
    def _top_ids(t) -> list[tuple[int, float]]:
        """Chat's top_logprobs, (token id, logprob) most likely first: the N most likely tokens and
        the chosen one after them where it is not among them (sampling can choose a token outside
        the N), as the completions API gives it; none where N is 0."""
        if not t.top or any(i == t.token_id for i, _ in t.top):
            return list(t.top)
        return [*t.top, (t.token_id, t.logprob)]

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    @property
    def num_speculative_tokens(self) -> int:
        """The cap this request drafted under: the server's K, or the request's where smaller."""
        k = self.settings.num_speculative_tokens
        return k if self.speculation_cap is None else min(k, self.speculation_cap)

    def prompt_logprobs(self, out: RequestOutput, index: int) -> dict | None:
        """The completions API's logprobs over the prompt's tokens (the first has none); the
        choice's text offsets go on after them."""
        if out.prompt_logprobs is None:
            return None
        first = self._token(out.prompt_token_ids[0])[0]
        self._offsets[index] = len(first)
        prompt = self.logprobs([t for t in out.prompt_logprobs if t is not None], index)
        return {"tokens": [first] + prompt["tokens"], "token_logprobs": [None] + prompt["token_logprobs"],
                "top_logprobs": [None] + prompt["top_logprobs"], "text_offset": [0] + prompt["text_offset"]}

    def echo_logprobs(self, out: RequestOutput, index: int) -> dict | None:
        """The completions API's logprobs over the prompt's tokens, then the output's."""
        if out.logprobs is None or out.prompt_logprobs is None:
            return None
        head, body = self.prompt_logprobs(out, index), self.logprobs(self.scored(out.logprobs, out), index)
        return {key: head[key] + body[key] for key in head}

    def echoed(self, out: RequestOutput) -> str:
        """The prompt as echo gives it back: its tokens decoded with the special ones kept, so that the
        text is the prompt that was sent and the logprobs' tokens and text offsets fall inside it."""
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def echo_chunk(self, out: RequestOutput, index: int, include_usage: bool) -> dict:
        """A streamed completion's first chunk with echo: the prompt's text and its logprobs."""
        body = self.chunk(index, self.echoed(out), None, include_usage)
        body["choices"][0]["logprobs"] = self.prompt_logprobs(out, index) if out.logprobs is not None else None
        return body

    def usage(self, outs: list[RequestOutput]) -> dict:
        spec = SpecStats()
        for o in outs:
            spec.merge(o.spec)
        completion = sum(len(o.token_ids) + (o.eos_token_id is not None) for o in outs)  # as vLLM: eos counts
        s = self.settings
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                # OpenAI's field: prompt tokens served from the prefix cache (the first choice's prompt:
                # the others share it, and the usage counts the prompt once)
                "prompt_tokens_details": {"cached_tokens": outs[0].num_cached_tokens if outs else 0},
                "speculative": {"method": s.spec_method, "num_speculative_tokens": self.num_speculative_tokens,
                                "num_drafts": spec.drafts_per_position[0] if spec.drafts_per_position else 0,
                                **spec.to_dict()}}

    def full(self, outs: list[RequestOutput]) -> dict:
        if self.chat:
            choices = [{"index": i, "message": m, "logprobs": self.logprobs(self.scored(o.logprobs, o), i),
                        "finish_reason": reason}
                       for i, o in enumerate(outs) for m, reason in [self.message(o)]]
        elif self.echo:  # the prompt as its tokens decode, then the completion; the first prompt token has no logprob
            choices = [{"index": i, "text": self.echoed(o) + o.text,
                        "logprobs": self.echo_logprobs(o, i), "finish_reason": o.finish_reason} for i, o in enumerate(outs)]
        else:
            choices = [{"index": i, "text": o.text, "logprobs": self.logprobs(self.scored(o.logprobs, o), i),
                        "finish_reason": o.finish_reason} for i, o in enumerate(outs)]
        if self.token_ids:
            for choice, o in zip(choices, outs):
                choice["token_ids"] = o.token_ids
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": self.usage(outs)}

    def chunk(self, index: int, text: str, finish_reason: str | None, include_usage: bool, role: bool = False,
              token_ids: list[int] | None = None, logprobs=None, tool_calls: list[dict] | None = None) -> dict:
        """One choice's chunk; ``logprobs``: those of the tokens this step emitted (the chunks'
        logprobs together are the whole response's, whatever the text held back for stop strings)."""
        lps = self.logprobs(logprobs, index) if logprobs else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if tool_calls:
                delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(tool_calls)]
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": finish_reason}
        if self.token_ids and not role:
            choice["token_ids"] = token_ids or []
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, outs: list[RequestOutput]) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": self.usage(outs)}

    def failure_body(self, out: RequestOutput) -> dict:
        if out.finish_reason == "abort":  # only a server stop aborts a request whose client is still there
            return error_body(503, "the server stopped before this request finished", "service_unavailable")
        return error_body(500, f"the request failed: {out.error or 'unknown error'}", "internal_error")

    def failure(self, out: RequestOutput) -> JSONResponse:
        body = self.failure_body(out)
        return JSONResponse(body, status_code=body["error"]["code"])
