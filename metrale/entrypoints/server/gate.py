"""The checks every HTTP request passes before routing, as one pure ASGI middleware.

In order: the API key (401 on every path but /health; constant-time, case-sensitive), the
drain (503 once SIGTERM arrived), the body size (413; the body is read here, at most
--max-body-bytes of it, and replayed to the app). The in-flight count it keeps is what the
drain waits on. Oversized headers never get here: uvicorn's h11 limit answers them with 431.
"""

from __future__ import annotations

import hmac

from metrale.entrypoints.server.errors import error_body
from metrale.entrypoints.server.state import ServerState
from metrale.entrypoints.server.streaming import json_bytes

OPEN_PATHS = ("/health",)


async def send_error(send, status: int, message: str, code: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
    body = json_bytes(error_body(status, message, None, code))
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _authorized(scope, api_key: bytes) -> bool:
    value = _header(scope, b"authorization") or b""
    scheme, _, token = value.partition(b" ")
    # compare_digest takes the same time wherever the first difference is.
    return hmac.compare_digest(scheme, b"Bearer") & hmac.compare_digest(token.strip(), api_key)


class GateMiddleware:
    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        key = state.config.api_key
        self.api_key = key.encode("utf-8") if key is not None else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        config, lifecycle = self.state.config, self.state.lifecycle
        if self.api_key is not None and path not in OPEN_PATHS and not _authorized(scope, self.api_key):
            await send_error(send, 401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                             "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            return
        if lifecycle.draining and path not in OPEN_PATHS:
            self.state.metrics.rejected.inc()
            await send_error(send, 503, "the server is shutting down", "shutting_down")
            return
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > config.max_body_bytes):
            await _reject_body(send, config.max_body_bytes)
            return
        body = await _read_body(receive, config.max_body_bytes)
        if body is None:
            await _reject_body(send, config.max_body_bytes)
            return
        lifecycle.requests_in_flight += 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            lifecycle.requests_in_flight -= 1


async def _reject_body(send, limit: int) -> None:
    await send_error(send, 413, f"the request body is larger than this server accepts ({limit} bytes)",
                     "request_too_large")


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or None past `limit` bytes. A client gone meanwhile reads as a short body."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
