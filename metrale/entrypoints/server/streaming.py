"""Server-sent events as OpenAI sends them, and the rule that a vanished client aborts its request.

A stream is `data: {json}\\n\\n` events and ends with `data: [DONE]\\n\\n`. An error after the
200 was sent travels as an event holding the error object, then [DONE].

Aborting: the SSE generator ends its RequestStream in a `finally`; Starlette cancels the
generator when the client disconnects, so the engine frees the request's KV blocks at its next
step. A non-streamed request watches the connection itself (`until_disconnected`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from metrale.engine.async_engine import RequestStream
from metrale.entrypoints.server.errors import api_error_of, error_body

SSE_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_bytes(payload: dict) -> bytes:
    # ensure_ascii=False keeps text readable; "replace" guarantees valid UTF-8 on the wire.
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def sse_event(payload: dict) -> bytes:
    return b"data: " + json_bytes(payload) + b"\n\n"


def sse_error(exc: BaseException) -> bytes:
    error = api_error_of(exc)
    return sse_event(error_body(error.status, error.message, error.param, error.code))


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)


async def abort_on_exit(streams: list[RequestStream], events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass events through; however the generator ends (done, error, client gone), end the streams.
    An exception after the headers went out becomes an error event."""
    try:
        async for event in events:
            yield event
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
        yield sse_error(e)
        yield SSE_DONE
    finally:
        for stream in streams:
            stream.abort()


async def until_disconnected(request: Request, work: Callable[[], Awaitable]):
    """Run `work()`; if the client disconnects first, cancel it (its finally blocks abort the
    engine requests) and return None: nobody is left to answer."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.wait({task})
    return None


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
