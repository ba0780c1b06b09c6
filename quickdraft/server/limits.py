"""Bounded request parsing: what a body may cost the server before any model work.

Four bounds, each checked before the next step would pay for what it guards:

- *body size*: the body is read in chunks and refused with a 413 once it passes
  ``max_body_bytes`` (a ``Content-Length`` above it is refused before reading);
- *nesting depth*: the raw bytes' bracket depth (outside strings) is measured with numpy before
  ``json.loads``, whose recursion a deep body would exhaust (a RecursionError, and deeper in
  pydantic a dropped connection); a 400 past ``MAX_JSON_DEPTH``;
- *valid Unicode*: JSON may escape a lone surrogate (``"\\ud800"``), which no UTF-8 text holds
  and the tokenizer refuses with a TypeError; a 400 naming the field;
- *prompt length*: a text's UTF-8 byte count bounds its token count from below (``PromptBound``),
  so a text that cannot fit the context is refused without tokenizing it.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import numpy as np
from starlette.requests import Request

from quickdraft.server.protocol import APIError

DEFAULT_MAX_BODY_BYTES = 32 * 2**20
# Deep enough for any JSON schema or tool definition seen in practice; json.loads recurses once a
# level and pydantic about three times, far below Python's default limit of 1,000 frames.
MAX_JSON_DEPTH = 64

# Larger bodies are scanned and parsed off the event loop (a 32 MiB one takes about a second),
# so that the streams it serves keep flowing meanwhile.
OFF_LOOP_BYTES = 2**20
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
