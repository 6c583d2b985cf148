"""uvicorn, adjusted: oversized headers get 431, and SIGTERM drains instead of cutting off.

Headers: h11 refuses a request head over its limit (--max-header-bytes) with a protocol error
whose status hint is 431, but uvicorn answers every protocol error with a plain-text 400. The
protocol below keeps h11's hint and answers in OpenAI's error shape.

Shutdown: the first SIGTERM starts a drain. The socket stays open and new requests get 503
(GateMiddleware), requests in flight run on; once none is left, or after --shutdown-timeout
seconds (then the rest are aborted and told so), uvicorn shuts down and the process exits 0.
SIGINT drains with a zero timeout; a second signal exits at once. uvicorn's habit of raising
the signal again after shutdown is dropped, so the exit status is ours: 0 after a drain, 1
when the engine failed to load or died.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from metrale.engine.async_engine import EngineState
from metrale.entrypoints.server.errors import error_body
from metrale.entrypoints.server.state import ServerState
from metrale.entrypoints.server.streaming import json_bytes

logger = logging.getLogger(__name__)

# After the engine died: keep answering /health with 503 this long, so probes see why.
DEAD_GRACE_SECONDS = 1.0
# After aborting what the drain timeout left: time for the error events to reach clients.
ABORT_FLUSH_SECONDS = 1.0


class _HintKeepingConnection:
    """An h11.Connection that remembers the status hint of the last protocol error.

    h11 measures only an incomplete head against its limit, so a large head that arrives in one
    read would pass; a complete head is measured here as well."""

    def __init__(self, conn: h11.Connection, max_head_bytes: int):
        self._conn = conn
        self.max_head_bytes = max_head_bytes
        self.error_status = 400

    def next_event(self):
        try:
            event = self._conn.next_event()
            if isinstance(event, h11.Request):
                size = len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
                if size > self.max_head_bytes:
                    raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
            return event
        except h11.RemoteProtocolError as e:
            self.error_status = e.error_status_hint if e.error_status_hint == 431 else 400
            raise

    def __getattr__(self, name):
        return getattr(self._conn, name)


class LimitedH11Protocol(H11Protocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _HintKeepingConnection(self.conn, self.config.h11_max_incomplete_event_size)

    def send_400_response(self, msg: str) -> None:
        status = self.conn.error_status
        if status == 431:
            message = "the request headers are larger than this server accepts"
        else:
            message = "invalid HTTP request"
        body = json_bytes(error_body(status, message, None, "request_header_fields_too_large"
                                     if status == 431 else "invalid_http_request"))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        reason = b"Request Header Fields Too Large" if status == 431 else b"Bad Request"
        conn = self.conn._conn
        self.transport.write(conn.send(h11.Response(status_code=status, headers=headers, reason=reason)))
        self.transport.write(conn.send(h11.Data(data=body)))
        self.transport.write(conn.send(h11.EndOfMessage()))
        self.transport.close()


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._dead_since: float | None = None
        self._aborted_at: float | None = None
        self._drain_logged = False

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        lifecycle = self.state.lifecycle
        if lifecycle.draining:
            self.should_exit = True
            self.force_exit = True
            return
        timeout = 0.0 if sig == signal.SIGINT else self.state.config.shutdown_timeout
        lifecycle.begin_drain(timeout)

    async def on_tick(self, counter: int) -> bool:
        if self._should_stop():
            return True
        return await super().on_tick(counter)

    def _should_stop(self) -> bool:
        lifecycle, engine = self.state.lifecycle, self.state.engine
        now = time.monotonic()
        if engine.state in (EngineState.FAILED, EngineState.DEAD):
            lifecycle.exit_code = 1
            if self._dead_since is None:
                self._dead_since = now
                logger.error("the engine %s; the server exits with status 1", "did not start"
                             if engine.state == EngineState.FAILED else "stopped on an error")
            return now - self._dead_since >= DEAD_GRACE_SECONDS or engine.state == EngineState.FAILED
        if not lifecycle.draining:
            return False
        if not self._drain_logged:
            self._drain_logged = True
            logger.info("shutting down: refusing new requests, draining %d in flight (timeout %.0fs)",
                        lifecycle.requests_in_flight, max(0.0, lifecycle.drain_deadline - now))
        if lifecycle.requests_in_flight == 0:
            logger.info("drained; shutting down")
            return True
        if self._aborted_at is None and now >= lifecycle.drain_deadline:
            logger.warning("shutdown timeout: aborting %d request(s) in flight", lifecycle.requests_in_flight)
            engine.abort_all("the server is shutting down")
            self._aborted_at = now
        return self._aborted_at is not None and now - self._aborted_at >= ABORT_FLUSH_SECONDS
