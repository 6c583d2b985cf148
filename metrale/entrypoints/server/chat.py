"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from metrale.engine.async_engine import RequestStream
from metrale.messages.outputs import RequestOutput
from metrale.entrypoints.server.choices import ChoiceCursor, check_output, final_output, usage, usage_of
from metrale.entrypoints.server.logprobs import chat_logprobs
from metrale.entrypoints.server.protocol import ChatCompletionRequest
from metrale.entrypoints.server.state import ServerState
from metrale.entrypoints.server.structured_outputs import with_structured_outputs
from metrale.entrypoints.server.streaming import SSE_DONE, abort_on_exit, sse_event, sse_response, until_disconnected


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    prompts, model = state.require_ready()
    state.check_model(body.model)
    body.check_supported()
    top_logprobs = body.engine_logprobs()
    params = body.sampling_params(max_tokens=body.resolved_max_tokens(), logprobs=top_logprobs,
                                  max_n=state.config.max_n, vocab_size=model.vocab_size,
                                  defaults=model.sampling_defaults)
    params = await with_structured_outputs(state, body, params)
    text, token_ids = await prompts.render_chat(body.messages, bool(body.add_generation_prompt),
                                                bool(body.continue_final_message))
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    prompt = {"prompt": text, "prompt_token_ids": token_ids}
    reply = _Reply(request_id, state.config.served_model_name, top_logprobs, bool(body.return_token_ids))

    if body.stream:
        stream = await state.engine.add_request(request_id, prompt, params)
        events = reply.events(stream, params.n, body.include_usage)
        return sse_response(abort_on_exit([stream], events))

    async def run() -> dict:
        # Not streamed: one output at the end spares the engine a cumulative copy every step.
        stream = await state.engine.add_request(request_id, prompt, params.clone(output_kind="final_only"))
        try:
            return reply.full(await final_output(stream))
        finally:
            stream.abort()

    result = await until_disconnected(request, run)
    return JSONResponse(result) if result is not None else Response(status_code=499)


class _Reply:
    def __init__(self, request_id: str, model: str, top_logprobs: int | None, return_token_ids: bool):
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.top_logprobs = top_logprobs
        self.return_token_ids = return_token_ids

    def _logprobs(self, entries: list | None) -> dict | None:
        if self.top_logprobs is None or entries is None:
            return None
        return chat_logprobs(entries, self.top_logprobs)

    def full(self, output: RequestOutput) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.logprobs), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in output.outputs]
        if self.return_token_ids:
            for choice, c in zip(choices, output.outputs):
                choice["token_ids"] = list(c.token_ids)
        return {"id": self.request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_of([output]), "system_fingerprint": None}

    def _chunk(self, choices: list[dict], include_usage: bool, usage_value: dict | None = None) -> bytes:
        chunk = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model, "system_fingerprint": None, "choices": choices}
        if include_usage:
            chunk["usage"] = usage_value
        return sse_event(chunk)

    async def events(self, stream: RequestStream, n: int, include_usage: bool) -> AsyncIterator[bytes]:
        """Role delta, content deltas, each choice's finish reason, the usage chunk, [DONE]."""
        yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(n)], include_usage)
        cursors = [ChoiceCursor() for _ in range(n)]
        last = None
        async for output in stream:
            check_output(output)
            last = output
            for completion in output.outputs:
                cursor = cursors[completion.index]
                if cursor.finished:
                    continue
                text, entries, token_ids = cursor.advance(completion)
                logprobs = self._logprobs(entries) if entries else None
                if text or logprobs or (self.return_token_ids and token_ids):
                    choice = {"index": completion.index, "delta": {"content": text}, "logprobs": logprobs,
                              "finish_reason": None}
                    if self.return_token_ids:
                        choice["token_ids"] = token_ids
                    yield self._chunk([choice], include_usage)
                if completion.finish_reason is not None:
                    cursor.finished = True
                    yield self._chunk([{"index": completion.index, "delta": {}, "logprobs": None,
                                        "finish_reason": completion.finish_reason,
                                        "stop_reason": completion.stop_reason}], include_usage)
        if include_usage and last is not None:
            yield self._chunk([], True, usage(len(last.prompt_token_ids),
                                              sum(len(c.token_ids) for c in last.outputs)))
        yield SSE_DONE
