"""The last line of the app: no exception reaches the ASGI server.

Starlette's own catch-all (``ServerErrorMiddleware``) answers a 500 and then re-raises, so that
uvicorn logs the error a second time ("Exception in ASGI application") and, where the response
had started, drops the connection. ``CatchAll`` sits inside it: an unexpected error becomes an
OpenAI-style 500 whose message carries a *request id* (also sent as ``X-Request-Id``), logged once
with its traceback under that id. A streaming response catches its own errors and ends with an
error event (app.py), so a started response reaching here is only closed.
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quickdraft.server.protocol import error_body

log = logging.getLogger("quickdraft.server")


def request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def internal_error(exc: BaseException, rid: str) -> dict:
    """OpenAI's error body for an unexpected error, naming the request id the log has."""
    detail = str(exc)[:200]
    return error_body(500, f"internal error (request id {rid}): {type(exc).__name__}"
                      + (f": {detail}" if detail else ""), "internal_error")


class CatchAll:
    def __init__(self, app: ASGIApp, on_error: Callable[[], None]):
        self.app = app
        self.on_error = on_error  # counts the failure in the server's metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            rid = request_id()
            log.exception("unhandled error in %s %s (request id %s)", scope.get("method"), scope.get("path"), rid)
            self.on_error()
            if not started:
                response = JSONResponse(internal_error(exc, rid), status_code=500, headers={"X-Request-Id": rid})
                await response(scope, receive, send)
