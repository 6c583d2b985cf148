"""`met serve`: the FastAPI app and the process around it.

One process, and the threads that matter: the asyncio loop (HTTP), two tokenizer lanes
(prompts.py) and the engine thread (AsyncEngine). Requests cross between them as Python objects in
memory; nothing is pickled and no internal socket exists.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import socket
import sys
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from metrale.config.engine_args import EngineArgs
from metrale.engine.async_engine import AsyncEngine, EngineOverloadedError, EngineState
from metrale.messages.errors import EngineDeadError
from metrale.entrypoints.server.args import ServerConfig
from metrale.entrypoints.server.chat import create_chat_completion
from metrale.entrypoints.server.completions import create_completion
from metrale.engine.profiling import StepProfiler
from metrale.entrypoints.server.errors import APIError, bad_request, error_response, install_error_handlers
from metrale.entrypoints.server.gate import GateMiddleware
from metrale.entrypoints.server.http_server import DrainingServer, LimitedH11Protocol
from metrale.entrypoints.server.memory import MemoryReport
from metrale.executor import oom_watchdog
from metrale.startup import build_llm_engine
from metrale.entrypoints.server.metrics import CONTENT_TYPE, ServerMetrics
from metrale.entrypoints.server.prompts import MediaSupport, PromptRenderer, media_refs_of
from metrale.multimodal.chat_parts import engine_modalities
from metrale.multimodal.fetch_policy import MediaFetchPolicy
from metrale.entrypoints.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                 ProfileRequest, TokenizeRequest, check_template_kwargs)
from metrale.entrypoints.server.state import Lifecycle, ModelInfo, ServerState

logger = logging.getLogger("metrale.serve")


def build_app(state: ServerState) -> FastAPI:
    memory: list[MemoryReport] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        started = time.perf_counter()
        state.engine.start()
        becoming_ready = asyncio.create_task(_become_ready(state, memory, started))
        try:
            yield
        finally:
            becoming_ready.cancel()
            state.engine.shutdown()
            if state.prompts is not None:
                state.prompts.close()

    app = FastAPI(title="met", summary="OpenAI-compatible LLM server", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(GateMiddleware, state=state)

    @app.get("/health", summary="200 when ready; 503 while loading, draining, stalled, or after the engine died")
    async def health() -> Response:
        lifecycle, engine = state.lifecycle, state.engine
        if engine.state in (EngineState.DEAD, EngineState.FAILED, EngineState.STOPPED):
            return error_response(503, f"the engine is {engine.state.value}", code="engine_dead")
        if lifecycle.draining:
            return error_response(503, "the server is shutting down", code="shutting_down")
        if not lifecycle.ready:
            return error_response(503, "the model is loading", code="loading", headers={"Retry-After": "1"})
        stalled = engine.stalled_for()
        if state.config.stall_timeout and stalled > state.config.stall_timeout:
            return error_response(503, f"the engine has been inside one step for {stalled:.0f} s", code="engine_stalled")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", summary="The served model")
    async def models() -> JSONResponse:
        _, model = state.require_ready()
        return JSONResponse({"object": "list", "data": [{
            "id": state.config.served_model_name, "object": "model", "created": model.created, "owned_by": "met",
            "root": model.model_dir, "parent": None, "max_model_len": model.max_model_len}]})

    @app.post("/v1/chat/completions", summary="Chat completion, streamed (SSE) or not")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _counting_rejections(state, create_chat_completion(state, body, request))

    @app.post("/v1/completions", summary="Text completion of one or more prompts, streamed (SSE) or not")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _counting_rejections(state, create_completion(state, body, request))

    @app.post("/tokenize", summary="Token ids of a prompt, or of chat messages after the chat template")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        prompts, model = state.require_ready()
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            refs = media_refs_of(body.messages)
            if refs:  # a count would miss every image's placeholder tokens
                prompts.media.check(refs)
                raise bad_request("/tokenize does not count the tokens of images and videos yet; send text "
                                  "parts only", "messages")
            tools = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
            _, tokens = await prompts.render_chat(body.messages, bool(body.add_generation_prompt), tools=tools,
                                                  template_kwargs=check_template_kwargs(body.chat_template_kwargs))
        else:
            tokens = await prompts.encode(body.prompt, bool(body.add_special_tokens))
        return JSONResponse({"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens})

    @app.post("/detokenize", summary="Text of token ids")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        prompts, _ = state.require_ready()
        state.check_model(body.model)
        return JSONResponse({"prompt": await prompts.decode(body.tokens)})

    @app.get("/metrics", summary="Prometheus metrics (met: prefix, vLLM names)")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/memory", summary="Per device: total and free bytes; weights, KV cache, activation reserve; KV blocks")
    async def memory_route() -> JSONResponse:
        state.require_ready()
        return JSONResponse(memory[0].as_dict())

    if state.config.profile_dir:
        @app.post("/start_profile", summary="Start the PyTorch profiler (for num_steps engine steps, or until "
                                             "/stop_profile); --profile DIR")
        async def start_profile(body: ProfileRequest | None = None) -> JSONResponse:
            state.require_ready()
            num_steps = body.num_steps if body is not None else None
            try:
                await state.engine.profile("start", num_steps)
            except RuntimeError as e:
                raise APIError(409, str(e), code="profiler_state") from None
            return JSONResponse({"status": "started", "num_steps": num_steps})

        @app.post("/stop_profile", summary="Stop the PyTorch profiler and write its trace")
        async def stop_profile() -> JSONResponse:
            state.require_ready()
            try:
                trace = await state.engine.profile("stop")
            except RuntimeError as e:
                raise APIError(409, str(e), code="profiler_state") from None
            return JSONResponse({"status": "stopped", "trace": trace})

    app.openapi = lambda: _openapi(app)
    return app


async def _counting_rejections(state: ServerState, handler):
    try:
        return await handler
    except EngineOverloadedError:
        state.metrics.rejected.inc()
        raise


def _openapi(app: FastAPI) -> dict:
    """FastAPI documents validation failures as 422; this server answers them with 400."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = {"description": "Invalid request: OpenAI's error object"}
        schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
        schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema


async def _become_ready(state: ServerState, memory: list, started: float) -> None:
    try:
        await state.engine.wait_until_loaded()
    except EngineDeadError:
        return  # DrainingServer sees the failed state and exits 1
    llm = state.engine.engine
    args = llm.args
    model_dir = llm.model_config.model_dir
    tokenizer_dir = None if args.skip_tokenizer_init else (args.tokenizer or model_dir)
    try:
        state.prompts = await asyncio.to_thread(PromptRenderer.load, tokenizer_dir, llm.model_config.vocab_size,
                                                llm.model_config.max_model_len)
        state.prompts.media = MediaSupport(state.config.served_model_name, engine_modalities(llm),
                                           state.media_policy or MediaFetchPolicy.from_engine_args(args))
        memory.append(MemoryReport(state.engine))
        state.metrics.on_ready(llm.runner.forward_mode, str(llm.device))
        oom_watchdog.start_for(llm, args.oom_watchdog_mib)
    except Exception as e:  # noqa: BLE001 - the server cannot serve; say why and exit
        logger.error("the server's tokenizer did not load: %s", e)
        state.lifecycle.exit_code = 1
        state.lifecycle.begin_drain(0.0)
        return
    state.model = ModelInfo(model_dir, llm.model_config.max_model_len, llm.model_config.vocab_size,
                            dict(llm.sampling_defaults))
    state.lifecycle.ready = True
    startup_log = getattr(llm, "startup_log", None)  # the engine's phases, so "ready" continues their numbering
    if startup_log is not None:
        startup_log.phase("ready", f"startup took {time.perf_counter() - started:.2f}s")
    else:
        logger.info("ready; startup took %.2fs", time.perf_counter() - started)
    config = state.config
    host = f"[{config.host}]" if ":" in config.host else config.host
    logger.info("serving %r at http://%s:%d/v1  (try: curl http://%s:%d/v1/models)", config.served_model_name,
                host, config.port, host, config.port)


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def run_server(args) -> int:
    try:
        engine_args = EngineArgs.from_cli_args(args)
        config = ServerConfig.from_cli_args(args)
        media_policy = MediaFetchPolicy.from_engine_args(engine_args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        sock = _bind(config.host, config.port)
    except OSError as e:
        print(f"error: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
        return 1
    if config.port == 0:
        config = dataclasses.replace(config, port=sock.getsockname()[1])
    metrics = ServerMetrics(config.served_model_name)
    profiler = StepProfiler(config.profile_dir) if config.profile_dir else None
    engine = AsyncEngine(functools.partial(build_llm_engine, engine_args, log_startup=True, reserved_cores=1),
                         max_waiting=config.max_waiting, observer=metrics, profiler=profiler)
    state = ServerState(config, engine, metrics, Lifecycle(), media_policy=media_policy)
    uvicorn_config = uvicorn.Config(
        build_app(state), http=LimitedH11Protocol, ws="none", lifespan="on", log_config=None,
        log_level="info" if config.access_log else "warning", access_log=config.access_log,
        h11_max_incomplete_event_size=config.max_header_bytes, timeout_graceful_shutdown=5,
        timeout_keep_alive=5)
    server = DrainingServer(uvicorn_config, state)
    try:
        server.run(sockets=[sock])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        engine.shutdown(timeout=1.0)
    return state.lifecycle.exit_code
