"""Bounded request parsing: what a body may cost the server before any model work.

Six bounds, each checked before the next step would pay for what it guards:

- *header size*: headers of more than ``MAX_HEADER_BYTES`` in all (uvicorn's parser takes any
  size) are a 400 before any route runs (``HeaderLimit``);
- *body size*: the body is read in chunks and refused with a 413 once it passes
  ``max_body_bytes`` (a ``Content-Length`` above it is refused before reading);
- *nesting depth*: the raw bytes' bracket depth (outside strings) is measured with numpy before
  ``json.loads``, whose recursion a deep body would exhaust (a RecursionError, and deeper in
  pydantic a dropped connection); a 400 past ``MAX_JSON_DEPTH``;
- *valid Unicode*: JSON may escape a lone surrogate (``"\\ud800"``), which no UTF-8 text holds
  and the tokenizer refuses with a TypeError; a 400 naming the field;
- *counts*: a model name longer than ``MAX_MODEL_NAME_CHARS``, more messages or prompt token ids
  than the context holds tokens (each message takes at least one), more logit_bias keys than the
  vocabulary has tokens, more tools than ``MAX_TOOLS``, are refused from the decoded JSON, before
  validation builds an object of each or a chat template renders them;
- *prompt length*: a text's UTF-8 byte count bounds its token count from below (``PromptBound``),
  so a text that cannot fit the context is refused without tokenizing it.

Memory a large body took is returned to the system afterwards (``ReturnMemory``): glibc keeps
freed blocks mapped in its heaps, and without the trim the server held what its largest requests
took (+88 MiB after 88 hostile requests; docs/serving-errors.md has the figures).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import re
from typing import Any, Callable

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quickdraft.server.protocol import APIError, error_body

DEFAULT_MAX_BODY_BYTES = 32 * 2**20
# Deep enough for any JSON schema or tool definition seen in practice; json.loads recurses once a
# level and pydantic about three times, far below Python's default limit of 1,000 frames.
MAX_JSON_DEPTH = 64

# Larger bodies are scanned and parsed off the event loop (a 32 MiB one takes about a second),
# so that the streams it serves keep flowing meanwhile.
OFF_LOOP_BYTES = 2**20
# A served model's name (a path, a Hugging Face id) is far shorter; a longer one is refused rather
# than looked up and echoed back.
MAX_MODEL_NAME_CHARS = 1024
# OpenAI's API takes at most 128 tools a request ("array_above_max_length"); more were validated
# and rendered through the chat template before the prompt's length refused them (5,000: seconds)
MAX_TOOLS = 128
# Above nginx's default (four 8 KiB buffers) and any API key or cookie seen in practice.
MAX_HEADER_BYTES = 32 * 2**10
# A body this large has memory returned to the system once its request is done, TRIM_DELAY_S later
TRIM_AFTER_BYTES = 256 * 2**10
TRIM_DELAY_S = 0.2
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_WINDOW = 2**20
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_STEP = np.zeros(256, np.int32)  # a byte's change of depth: +1 for [ and {, -1 for ] and }
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, or a 413 as soon as it is known to exceed ``max_bytes``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def decode_body(raw: bytes) -> Any:
    """The JSON value of a body read by read_body: depth checked, parsed, strings checked."""
    return await asyncio.to_thread(_decode, raw) if len(raw) > OFF_LOOP_BYTES else _decode(raw)


def _decode(raw: bytes) -> Any:
    check_depth(raw)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    check_unicode(raw, body)
    return body


def check_counts(body: Any, max_model_len: int, vocab_size: int) -> None:
    """A 400 for a decoded body whose model name is too long, whose messages or prompt token ids
    outnumber the tokens the context holds, whose logit_bias has more keys than the vocabulary
    has tokens, or whose tools are more than MAX_TOOLS: found from the lengths alone, before
    validation."""
    if not isinstance(body, dict):
        return
    model = body.get("model")
    if isinstance(model, str) and len(model) > MAX_MODEL_NAME_CHARS:
        raise APIError(400, f"the model name has {len(model)} characters; a model name has at most "
                       f"{MAX_MODEL_NAME_CHARS}", param="model", code="model_name_too_long")
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) >= max_model_len:
        raise APIError(400, f"the request has {len(messages)} messages, but the context holds {max_model_len} "
                       "tokens and each message takes at least one", param="messages", code="context_length_exceeded")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) and len(prompt) >= max_model_len:
        raise APIError(400, f"the prompt has {len(prompt)} tokens, but the context holds {max_model_len}: no room "
                       "is left to generate", param="prompt", code="context_length_exceeded")
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > vocab_size:
        raise APIError(400, f"logit_bias has {len(bias)} keys, but the vocabulary has {vocab_size} tokens",
                       param="logit_bias")
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise APIError(400, f"the request has {len(tools)} tools; at most {MAX_TOOLS} are supported",
                       param="tools", code="array_above_max_length")


class HeaderLimit:
    """ASGI middleware: a 400 in OpenAI's format for a request whose header names and values take
    more than MAX_HEADER_BYTES in all; ``on_refuse`` counts it in the server's metrics."""

    def __init__(self, app: ASGIApp, on_refuse: Callable[[], None]):
        self.app = app
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        size = sum(len(k) + len(v) for k, v in scope.get("headers", ())) if scope["type"] == "http" else 0
        if size <= MAX_HEADER_BYTES:
            await self.app(scope, receive, send)
            return
        self.on_refuse()
        body = error_body(400, f"the request's headers take {size} bytes; this server takes at most "
                          f"{MAX_HEADER_BYTES}", "invalid_request_error", code="request_headers_too_large")
        await JSONResponse(body, status_code=400)(scope, receive, send)


class ReturnMemory:
    """ASGI middleware: once the last request with a body of more than TRIM_AFTER_BYTES is done
    (its response sent), glibc's ``malloc_trim(0)`` TRIM_DELAY_S later, once for all the requests
    done meanwhile: the free pages of every malloc arena go back to the system. Counted from the
    bytes the app received, so a body refused with a 413 part way counts too. A no-op where the C
    library has no malloc_trim (musl, macOS)."""

    def __init__(self, app: ASGIApp):
        self.app = app
        name = ctypes.util.find_library("c")
        self._trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
        self._large = 0  # requests with a large body not yet done
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._trim is None:
            await self.app(scope, receive, send)
            return
        size, large = 0, False

        async def counted() -> Message:
            nonlocal size, large
            message = await receive()
            size += len(message.get("body", b""))
            if not large and size > TRIM_AFTER_BYTES:
                large = True
                self._large += 1
                if self._timer is not None:  # a trim now would come before this body is freed
                    self._timer.cancel()
                    self._timer = None
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if large:
                self._large -= 1
                if self._large == 0 and self._timer is None:
                    self._timer = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._run)

    def _run(self) -> None:
        self._timer = None
        self._trim(0)


def _too_large(size: int, max_bytes: int) -> APIError:
    return APIError(413, f"the request body has at least {size} bytes; this server takes at most {max_bytes} "
                    "(--max-body-bytes)", code="request_too_large")


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw``, brackets inside strings skipped. A
    quote opens or closes a string unless an odd run of backslashes precedes it. Linear, a window
    of bytes at a time with the state carried across (a regular expression over strings backtracks
    quadratically on a body of escaped quotes). On malformed JSON the figure is only an estimate;
    ``json.loads`` then reports the error."""
    data = np.frombuffer(raw, np.uint8)
    deepest = depth = run = quotes = 0  # run: backslashes just before the window; quotes: parity so far
    for start in range(0, len(data), _WINDOW):
        part = data[start : start + _WINDOW]
        at = np.arange(len(part))
        slash = part == _BACKSLASH
        last_other = np.maximum.accumulate(np.where(slash, -1, at))  # [n] last non-backslash at or before i
        before = np.empty(len(part), np.int64)  # [n] backslashes right before position i
        before[0] = run
        before[1:] = at[1:] - 1 - last_other[:-1] + np.where(last_other[:-1] < 0, run, 0)
        quote = (part == _QUOTE) & (before % 2 == 0)
        parity = (np.cumsum(quote) + quotes) % 2  # [n] 1 inside a string (its opening quote included)
        sums = np.cumsum(_STEP[part] * (parity == 0)) + depth
        deepest, depth, quotes = max(deepest, int(sums.max())), int(sums[-1]), int(parity[-1])
        run = run + len(part) if last_other[-1] < 0 else len(part) - 1 - int(last_other[-1])
    return deepest


def check_depth(raw: bytes) -> None:
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests arrays and objects {depth} levels deep; at most "
                       f"{MAX_JSON_DEPTH} are allowed", code="json_too_deep")


def check_unicode(raw: bytes, body: Any) -> None:
    """A 400 naming the first field whose string (or key) is not valid Unicode text: an escaped
    lone surrogate. Walked only when the raw body holds such an escape."""
    if _SURROGATE_ESCAPE.search(raw) is None:
        return
    path = _bad_string(body, [])
    if path is not None:
        param = ".".join(path) or None
        raise APIError(400, f"{param or 'the request body'}: the string holds a lone UTF-16 surrogate "
                       "(such as \\ud800), which is not valid Unicode text", param=param, code="invalid_unicode")


def _bad_string(value: Any, path: list[str]) -> list[str] | None:
    """The path to the first string that does not encode to UTF-8 (depth is bounded by check_depth)."""
    if isinstance(value, str):
        return None if _valid(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            if not _valid(key):
                return path + [key.encode("utf-8", "backslashreplace").decode()]
            found = _bad_string(item, path + [key])
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _bad_string(item, path + [str(i)])
            if found is not None:
                return found
    return None


def _valid(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class PromptBound:
    """A lower bound on a text's token count from its UTF-8 byte count, to refuse a prompt that
    cannot fit the context without tokenizing it.

    Every token of a byte-level BPE covers at most ``longest`` bytes of the text (its longest
    token's bytes), so a text of B bytes has at least B / longest tokens. A normalizer may shrink
    the text first (Qwen's NFC composes up to four code points into one, at most three bytes into
    one), hence ``shrink``: the bound assumes the text may lose up to that factor before splitting.
    """

    shrink = 4

    def __init__(self, tokenizer, max_model_len: int):
        self.longest = max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
        self.max_model_len = max_model_len

    def min_tokens(self, text: str) -> int:
        return len(text.encode("utf-8")) // (self.longest * self.shrink)

    def check(self, text: str, param: str) -> None:
        """A 400 where ``text`` has at least max_model_len tokens for certain."""
        at_least = self.min_tokens(text)
        if at_least >= self.max_model_len:
            raise APIError(400, f"the prompt has at least {at_least} tokens ({len(text)} characters), but the "
                           f"context holds {self.max_model_len}", param=param, code="context_length_exceeded")
