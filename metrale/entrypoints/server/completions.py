"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + i."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from metrale.engine.async_engine import RequestStream
from metrale.messages.outputs import RequestOutput
from metrale.messages.sampling_params import SamplingParams
from metrale.entrypoints.server.choices import ChoiceCursor, check_output, final_output, usage_of
from metrale.entrypoints.server.logprobs import completion_logprobs
from metrale.entrypoints.server.protocol import CompletionRequest
from metrale.entrypoints.server.state import ServerState
from metrale.entrypoints.server.structured_outputs import with_structured_outputs
from metrale.entrypoints.server.streaming import SSE_DONE, abort_on_exit, sse_event, sse_response, until_disconnected


async def create_completion(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    prompts, model = state.require_ready()
    state.check_model(body.model)
    body.check_supported()
    logprobs = body.engine_logprobs()
    params = body.sampling_params(max_tokens=body.max_tokens, logprobs=logprobs, max_n=state.config.max_n,
                                  vocab_size=model.vocab_size, defaults=model.sampling_defaults)
    params = await with_structured_outputs(state, body, params)
    engine_prompts = []
    for i, prompt in enumerate(body.prompts()):
        if isinstance(prompt, str):
            engine_prompts.append({"prompt": prompt, "prompt_token_ids": await prompts.encode(prompt)})
        else:
            prompts.check_token_ids(prompt, "prompt")
            text = await prompts.decode(prompt, "prompt") if body.echo and prompts.tokenizer else None
            engine_prompts.append({"prompt": text, "prompt_token_ids": prompt})
    request_id = f"cmpl-{uuid.uuid4().hex}"
    reply = _Reply(request_id, state.config.served_model_name, logprobs, bool(body.echo), params.n,
                   bool(body.return_token_ids))

    if body.stream:
        streams = await _add_all(state, request_id, engine_prompts, params)
        return sse_response(abort_on_exit(streams, reply.events(streams, body.include_usage, engine_prompts)))

    async def run() -> dict:
        # Not streamed: one output at the end spares the engine a cumulative copy every step.
        streams = await _add_all(state, request_id, engine_prompts, params.clone(output_kind="final_only"))
        try:
            outputs = await asyncio.gather(*(final_output(s) for s in streams))
            return reply.full(outputs, engine_prompts)
        finally:
            for stream in streams:
                stream.abort()

    result = await until_disconnected(request, run)
    return JSONResponse(result) if result is not None else Response(status_code=499)


async def _add_all(state: ServerState, request_id: str, prompts: list[dict],
                   params: SamplingParams) -> list[RequestStream]:
    if len(prompts) == 1:
        return [await state.engine.add_request(request_id, prompts[0], params)]
    return await state.engine.add_requests([(f"{request_id}-{i}", prompt, params) for i, prompt in enumerate(prompts)])


class _Reply:
    def __init__(self, request_id: str, model: str, logprobs: int | None, echo: bool, n: int,
                 return_token_ids: bool):
        self.return_token_ids = return_token_ids
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.echo = echo
        self.n = n

    def _prefix(self, prompt: dict) -> str:
        return (prompt.get("prompt") or "") if self.echo else ""

    def full(self, outputs: list[RequestOutput], prompts: list[dict]) -> dict:
        choices = []
        for p, (output, prompt) in enumerate(zip(outputs, prompts)):
            prefix = self._prefix(prompt)
            for c in output.outputs:
                logprobs = (completion_logprobs(c.logprobs, self.logprobs, len(prefix))
                            if self.logprobs is not None and c.logprobs is not None else None)
                choices.append({"index": p * self.n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if self.return_token_ids:
                    choices[-1]["token_ids"] = list(c.token_ids)
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_of(outputs), "system_fingerprint": None}

    def _chunk(self, choice: dict, include_usage: bool) -> bytes:
        chunk = {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": [choice], "system_fingerprint": None}
        if include_usage:
            chunk["usage"] = None
        return sse_event(chunk)

    async def events(self, streams: list[RequestStream], include_usage: bool,
                     prompts: list[dict]) -> AsyncIterator[bytes]:
        cursors = {}
        for p, prompt in enumerate(prompts):
            for i in range(self.n):
                cursor = cursors[p * self.n + i] = ChoiceCursor()
                prefix = self._prefix(prompt)
                cursor.offset = len(prefix)
                if prefix:
                    yield self._chunk({"index": p * self.n + i, "text": prefix, "logprobs": None,
                                       "finish_reason": None}, include_usage)
        last: dict[int, RequestOutput] = {}
        async for p, output in _merge(streams):
            check_output(output)
            last[p] = output
            for completion in output.outputs:
                index = p * self.n + completion.index
                cursor = cursors[index]
                if cursor.finished:
                    continue
                text, entries, token_ids = cursor.advance(completion)
                logprobs = None
                if self.logprobs is not None and entries:
                    logprobs = completion_logprobs(entries, self.logprobs, cursor.offset)
                    cursor.offset += sum(len(t) for t in logprobs["tokens"])
                if text or logprobs or (self.return_token_ids and token_ids):
                    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
                    if self.return_token_ids:
                        choice["token_ids"] = token_ids
                    yield self._chunk(choice, include_usage)
                if completion.finish_reason is not None:
                    cursor.finished = True
                    yield self._chunk({"index": index, "text": "", "logprobs": None,
                                       "finish_reason": completion.finish_reason,
                                       "stop_reason": completion.stop_reason}, include_usage)
        if include_usage:
            yield sse_event({"id": self.request_id, "object": "text_completion", "created": self.created,
                             "model": self.model, "choices": [], "system_fingerprint": None,
                             "usage": usage_of([last[p] for p in sorted(last)])})
        yield SSE_DONE


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    output = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, output
    finally:
        for future in pending:
            future.cancel()
