"""AsyncEngine: the LLMEngine on one thread of its own, driven from asyncio.

The engine is not thread-safe, so exactly one thread (the engine thread) builds it and touches
it. That thread loops `step()` while any request is unfinished and sleeps on a condition when
idle. The event loop talks to it through an inbox of commands (add, abort) that the thread
drains between steps; whether each add was accepted goes back before the next step runs, and
results come back in one `loop.call_soon_threadsafe` per step, which hands each request's
newest RequestOutput to its RequestStream. Everything stays in one process: nothing is pickled
or sent over a socket.

An abort lands at the next step boundary: its blocks go back to the pool there and the snapshot
says so before another step runs. A step is never interrupted, so the length of one step is
what an abort waits for (EngineArgs.step_token_budget keeps CPU steps short; docs/server.md,
"Abort latency").

Outputs are cumulative (text and token ids so far), so a stream keeps only the newest one:
a consumer slower than the engine skips intermediate outputs and loses nothing.

If the loop raises, the engine is dead: every open stream fails with EngineDeadError and
`state` says so, so /health can answer 503 and the server can exit non-zero.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from metrale.config.errors import wants_traceback
from metrale.engine.profiling import StepProfiler
from metrale.engine.spec_stats import SpecDecodeStats
from metrale.messages.errors import EngineDeadError, InvalidRequestError
from metrale.messages.outputs import RequestOutput
from metrale.messages.sampling_params import SamplingParams

if TYPE_CHECKING:
    from metrale.engine.engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the caller should retry later (HTTP 503 + Retry-After)."""


class EngineNotReadyError(RuntimeError):
    """The model is still loading."""


class RequestAbortedError(RuntimeError):
    """The server ended the request (shutdown past its drain timeout)."""


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"  # the model could not be loaded
    DEAD = "dead"  # the engine loop raised
    STOPPED = "stopped"  # shut down on purpose


@dataclass(frozen=True)
class EngineSnapshot:
    """The scheduler's numbers after the last step, published by the engine thread."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    state_slots_total: int = 0  # running slots of a model with per-request state (0: none)
    state_slots_free: int = 0
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters, when it is on


class EngineObserver:
    """Hooks called on the engine thread (the server's metrics implement them)."""

    def on_request_added(self, request_id: str, arrival_time: float) -> None: ...

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_request_aborted(self, request_id: str) -> None: ...

    def on_snapshot(self, snapshot: EngineSnapshot) -> None: ...


@dataclass
class _Add:
    request_id: str
    prompt: object
    params: SamplingParams
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Profile:
    """Start or stop the step profiler; `reply` is resolved on the loop with the outcome."""
    action: str  # "start" or "stop"
    num_steps: int | None
    reply: asyncio.Future


_ACCEPTED = object()


class RequestStream:
    """One request's outputs, newest only. Lives on the event loop; iterate it with `async for`.

    A consumer that stops early must call `abort()` (generate() does it in its finally).
    """

    def __init__(self, request_id: str, num_seqs: int, owner: "AsyncEngine"):
        self.request_id = request_id
        self.num_seqs = num_seqs
        self._owner = owner
        self._accepted = asyncio.get_running_loop().create_future()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()
        self.done = False

    # -- the engine side (called on the loop by AsyncEngine._deliver) ------------------------

    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self._wakeup.set()

    def _fail(self, error: BaseException) -> None:
        if not self._accepted.done():
            self._accepted.set_exception(error)
        self._error = error
        self._wakeup.set()

    def _accept(self) -> None:
        if not self._accepted.done():
            self._accepted.set_result(None)

    # -- the consumer side -------------------------------------------------------------------

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        while self._latest is None and self._error is None:
            self._wakeup.clear()
            await self._wakeup.wait()
        if self._latest is not None:
            output, self._latest = self._latest, None
            if output.finished:
                self._close(abort=False)
            return output
        self._close(abort=False)
        raise self._error

    def abort(self) -> None:
        """Stop the request if it is still running; its KV blocks go back to the pool."""
        self._close(abort=True)

    def _close(self, abort: bool) -> None:
        if self.done:
            return
        self.done = True
        self._owner._forget(self, abort and self._error is None)


class AsyncEngine:
    def __init__(self, make_engine: Callable[[], "LLMEngine"], *, max_waiting: int,
                 observer: EngineObserver | None = None, profiler: StepProfiler | None = None):
        """`make_engine` builds the LLMEngine; it runs on the engine thread (startup.build_llm_engine).
        `profiler`: the PyTorch profiler the /start_profile and /stop_profile routes drive."""
        self.make_engine = make_engine
        self.profiler = profiler
        self.max_waiting = max_waiting
        self.observer = observer or EngineObserver()
        self.state = EngineState.LOADING
        self.error: BaseException | None = None
        self.engine = None  # the LLMEngine, once loaded; only the engine thread calls into it
        self.snapshot = EngineSnapshot()
        self.step_started: float | None = None  # when the step in progress began (engine thread writes)
        self._cond = threading.Condition()
        self._inbox: list[_Add | _Abort | _Profile] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = None  # asyncio.Event, made on the loop in start()
        self._streams: dict[str, RequestStream] = {}  # loop side only
        self._num_seqs_in_flight = 0
        self.max_num_seqs = 0  # the scheduler's, once loaded (the flag may say "auto")

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread: it loads the model, then serves. Call from the event loop."""
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._thread = threading.Thread(target=self._thread_main, name="met-engine", daemon=True)
        self._thread.start()

    async def wait_until_loaded(self) -> None:
        """Returns once the model is loaded; raises if loading failed."""
        await self._ready.wait()
        if self.state != EngineState.READY:
            raise EngineDeadError(f"the engine did not start: {self.error}")

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:  # streams belong to the loop; once it is closed nobody waits on them
            self._fail_all(EngineDeadError("the engine was shut down"))

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._streams)

    # -- requests (event loop side) ------------------------------------------------------------

    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        Raises what LLMEngine.add_request raises (InvalidRequestError, ...), EngineOverloadedError
        when the waiting queue is full, EngineNotReadyError or EngineDeadError.
        """
        return (await self.add_requests([(request_id, prompt, params)]))[0]

    async def add_requests(self, requests: list[tuple[str, object, SamplingParams]]) -> list[RequestStream]:
        """Several requests, all or none: they reach the engine together, and if one is refused
        (or the caller is cancelled) the others are aborted."""
        streams: list[RequestStream] = []
        try:
            if not self.would_admit(sum(params.n for _, _, params in requests)):
                raise self._overloaded()
            for request_id, _, params in requests:
                streams.append(self._open(request_id, params.n))
            now = time.monotonic()
            self._submit(*(_Add(request_id, prompt, params, now) for request_id, prompt, params in requests))
            accepted = [stream._accepted for stream in streams]
            await asyncio.wait(accepted)
            errors = [future.exception() for future in accepted]  # retrieve all: no "never retrieved" noise
            first_error = next((e for e in errors if e is not None), None)
            if first_error is not None:
                raise first_error
        except BaseException:
            for stream in streams:
                stream.abort()  # a no-op for the refused ones; cancels the accepted ones
            raise
        return streams

    async def generate(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; stopping early aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def profile(self, action: str, num_steps: int | None = None) -> str | None:
        """Start the profiler (for `num_steps` steps, or until stopped) or stop it, between steps on
        the engine thread; stopping returns the trace's path. Raises RuntimeError when that cannot
        be done (no profiler, already running, not running)."""
        if self.profiler is None:
            raise RuntimeError("the server runs without a profiler; start it with --profile DIR")
        reply = asyncio.get_running_loop().create_future()
        self._submit(_Profile(action, num_steps, reply))
        return await reply

    def abort_all(self, reason: str) -> None:
        """End every open request (drain timeout): consumers get RequestAbortedError."""
        for stream in list(self._streams.values()):
            stream._fail(RequestAbortedError(reason))
            self._submit(_Abort(stream.request_id))

    def would_admit(self, num_seqs: int) -> bool:
        """Whether `num_seqs` more sequences fit under the running limit plus --max-waiting."""
        if num_seqs <= 0:
            return True
        queued_after = self._num_seqs_in_flight + num_seqs - self.max_num_seqs
        # The scheduler's own waiting count covers the case where KV blocks, not max_num_seqs,
        # are what keeps requests waiting.
        return queued_after <= self.max_waiting and self.snapshot.num_waiting <= self.max_waiting

    def _open(self, request_id: str, num_seqs: int) -> RequestStream:
        if self.state == EngineState.LOADING:
            raise EngineNotReadyError("the model is still loading")
        if self.state != EngineState.READY:
            raise EngineDeadError(f"the engine is not running ({self.state.value}): {self.error}")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not self.would_admit(num_seqs):
            raise self._overloaded()
        stream = RequestStream(request_id, num_seqs, self)
        self._streams[request_id] = stream
        self._num_seqs_in_flight += num_seqs
        return stream

    def _overloaded(self) -> EngineOverloadedError:
        return EngineOverloadedError(f"the server is at capacity ({self.max_num_seqs} running, "
                                     f"{self.max_waiting} waiting); retry later")

    def _forget(self, stream: RequestStream, abort: bool) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            self._num_seqs_in_flight -= stream.num_seqs
        if abort:
            self._submit(_Abort(stream.request_id))

    def _submit(self, *commands: _Add | _Abort | _Profile) -> None:
        with self._cond:
            self._inbox.extend(commands)
            self._cond.notify()

    def _deliver(self, accepted: list[tuple[str, object]], outputs: list[RequestOutput]) -> None:
        """On the loop: hand results to their streams (unknown ids were aborted meanwhile)."""
        for request_id, result in accepted:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if result is _ACCEPTED:
                stream._accept()
            else:
                stream._fail(result)
                self._forget(stream, abort=False)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream._put(output)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream._fail(error)

    def _on_loop(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            pass

    # -- the engine thread ---------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            self.engine = self.make_engine()
        except BaseException as e:  # noqa: BLE001 - any load failure ends the server
            logger.error("the engine failed to start: %s", e, exc_info=wants_traceback(e))
            self.error = e
            self.state = EngineState.FAILED
            self._on_loop(self._ready.set)
            return
        self.max_num_seqs = self.engine.scheduler.max_num_seqs
        self._publish_snapshot()
        self.state = EngineState.READY
        self._on_loop(self._ready.set)
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the loop is dead either way; say why
            logger.exception("the engine loop stopped")
            self.error = e
            self.state = EngineState.DEAD
            self._on_loop(self._fail_all, EngineDeadError(f"the engine stopped: {e!r}"))
            return
        self.state = EngineState.STOPPED

    def stalled_for(self) -> float:
        """Seconds the step in progress has been running (0 between steps)."""
        started = self.step_started
        return 0.0 if started is None else time.monotonic() - started

    def _serve(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._inbox and not self._stopping and not engine.has_unfinished_requests():
                    self._cond.wait()
                if self._stopping:
                    return
                commands, self._inbox = self._inbox, []
            accepted, aborted = self._apply(commands)
            # Both before the step, which may be long (a prefill chunk on the CPU): accepted
            # streams start now, so a client gone meanwhile is seen (and aborted) a step sooner;
            # aborted requests' blocks are back in the pool, and /metrics and /memory say so.
            if accepted:
                self._on_loop(self._deliver, accepted, [])
            if aborted:
                self._publish_snapshot()
            stepped = engine.has_unfinished_requests()
            self.step_started = time.monotonic() if stepped else None
            outputs = engine.step() if stepped else []
            self.step_started = None
            if stepped and self.profiler is not None:
                self.profiler.after_step()
            if outputs:
                self.observer.on_outputs(outputs, time.monotonic())
            if stepped:
                self._publish_snapshot()
            if outputs:
                self._on_loop(self._deliver, [], outputs)

    def _apply(self, commands: list[_Add | _Abort | _Profile]) -> tuple[list[tuple[str, object]], bool]:
        accepted: list[tuple[str, object]] = []
        aborted = False
        for command in commands:
            if isinstance(command, _Profile):
                self._apply_profile(command)
                continue
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                self.observer.on_request_aborted(command.request_id)
                aborted = True
                continue
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params,
                                        arrival_time=command.arrival_time)
            except ValueError as e:  # InvalidRequestError and the scheduler's capacity check
                accepted.append((command.request_id, e))
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the engine
                logger.exception("add_request failed for %s", command.request_id)
                accepted.append((command.request_id, e))
            else:
                self.observer.on_request_added(command.request_id, command.arrival_time)
                accepted.append((command.request_id, _ACCEPTED))
        return accepted, aborted

    def _apply_profile(self, command: _Profile) -> None:
        try:
            result = self.profiler.start(command.num_steps) if command.action == "start" else self.profiler.stop()
        except RuntimeError as e:
            self._on_loop(_settle, command.reply, None, e)
        else:
            self._on_loop(_settle, command.reply, result, None)

    def _publish_snapshot(self) -> None:
        scheduler = self.engine.scheduler
        stats = scheduler.stats()
        self.snapshot = EngineSnapshot(stats.num_running, stats.num_waiting, stats.kv_cache_usage,
                                       stats.num_preemptions_total, scheduler.kv.num_blocks,
                                       scheduler.kv.num_free_blocks, stats.prefix_cache_queries_total,
                                       stats.prefix_cache_hits_total, scheduler.kv.slots.num_running,
                                       scheduler.kv.num_free_state_slots, stats.spec_decode)
        self.observer.on_snapshot(self.snapshot)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
