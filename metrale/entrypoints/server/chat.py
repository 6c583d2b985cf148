"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from metrale.engine.async_engine import RequestStream
from metrale.messages.outputs import RequestOutput
from metrale.entrypoints.server.assistant_output import (DeltaBuilder, MessageBuilder, OutputPlan, finish_reason,
                                                         plan_output)
from metrale.entrypoints.server.choices import ChoiceCursor, check_output, final_output, usage, usage_of
from metrale.entrypoints.server.logprobs import chat_logprobs
from metrale.entrypoints.server.protocol import ChatCompletionRequest, check_template_kwargs
from metrale.entrypoints.server.state import ServerState
from metrale.entrypoints.server.structured_outputs import (constrain, tool_call_structured_outputs,
                                                           with_structured_outputs)
from metrale.entrypoints.server.streaming import SSE_DONE, abort_on_exit, sse_event, sse_response, until_disconnected


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    prompts, model = state.require_ready()
    state.check_model(body.model)
    body.check_supported()
    config = state.config
    plan = plan_output(body, config.reasoning_parser, config.tool_call_parser, config.enable_auto_tool_choice)
    top_logprobs = body.engine_logprobs()
    params = body.sampling_params(max_tokens=body.resolved_max_tokens(), logprobs=top_logprobs,
                                  max_n=state.config.max_n, vocab_size=model.vocab_size,
                                  defaults=model.sampling_defaults)
    params = await with_structured_outputs(state, body, params)
    if params.structured_outputs is not None:
        plan = plan.under_grammar()
    params = await constrain_tool_calls(state, body, params, plan)
    text, token_ids = await prompts.render_chat(body.messages, bool(body.add_generation_prompt),
                                                bool(body.continue_final_message), plan.template_tools,
                                                check_template_kwargs(body.chat_template_kwargs))
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    media = await prompts.load_media(body.messages)
    # With media, the engine's processor expands each placeholder from the text: the ids of the
    # template's text alone would be short of them.
    prompt = ({"prompt": text, "prompt_token_ids": token_ids} if media is None
              else {"prompt": text, "multi_modal_data": media})
    reply = _Reply(request_id, state.config.served_model_name, top_logprobs, bool(body.return_token_ids), plan, text)

    if body.stream:
        stream = await state.engine.add_request(request_id, prompt, params)
        events = reply.events(stream, params.n, body.include_usage)
        return sse_response(abort_on_exit([stream], events))

    async def run() -> dict:
        # Not streamed: one output at the end spares the engine a cumulative copy every step.
        stream = await state.engine.add_request(request_id, prompt, params.clone(output_kind="final_only"))
        try:
            return await reply.full_off_loop(await final_output(stream))
        finally:
            stream.abort()

    result = await until_disconnected(request, run)
    return JSONResponse(result) if result is not None else Response(status_code=499)


# Parsing is linear, under 1 ms per KB of the worst text found (tests/entrypoints/test_parser_bounds.py):
# up to this much it runs on the loop.
PARSE_ON_LOOP_CHARS = 32 * 1024


async def constrain_tool_calls(state: ServerState, body: ChatCompletionRequest, params, plan: OutputPlan):
    """A forced call (tool_choice required or named) is generated under the grammar of the
    functions' schemas: named, the arguments object; required, an array of {name, parameters}."""
    if not plan.forces_calls:
        return params
    spec = tool_call_structured_outputs(body.tools, body.tool_choice, plan.parallel_tool_calls)
    return await constrain(state, params, spec, "tool_choice")


class _Reply:
    def __init__(self, request_id: str, model: str, top_logprobs: int | None, return_token_ids: bool,
                 plan: OutputPlan, prompt: str):
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.top_logprobs = top_logprobs
        self.return_token_ids = return_token_ids
        self.plan = plan
        self.prompt = prompt  # the rendered prompt: where it ends tells a reasoning parser where the output starts

    def _logprobs(self, entries: list | None) -> dict | None:
        if self.top_logprobs is None or entries is None:
            return None
        return chat_logprobs(entries, self.top_logprobs)

    def _message(self, text: str) -> dict:
        if not self.plan.shapes_output:
            return {"role": "assistant", "content": text}
        choice, message = self.plan.choice(self.prompt), MessageBuilder(self.plan)
        message.add(choice.feed(text))
        message.add(choice.finish())
        return message.message()

    async def full_off_loop(self, output: RequestOutput) -> dict:
        """`full`, on a worker thread when there is much text to parse, so the event loop (and
        /health) keeps answering while a long output is read for reasoning and tool calls."""
        if self.plan.shapes_output and sum(len(c.text) for c in output.outputs) > PARSE_ON_LOOP_CHARS:
            return await asyncio.to_thread(self.full, output)
        return self.full(output)

    def full(self, output: RequestOutput) -> dict:
        choices = []
        for c in output.outputs:
            message = self._message(c.text)
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c.logprobs),
                            "finish_reason": finish_reason(c.finish_reason, bool(message.get("tool_calls"))),
                            "stop_reason": c.stop_reason})
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
        shaping = self.plan.shapes_output
        outputs = [self.plan.choice(self.prompt) for _ in range(n)] if shaping else []
        builders = [DeltaBuilder() for _ in range(n)]
        last = None
        async for output in stream:
            check_output(output)
            last = output
            for completion in output.outputs:
                index = completion.index
                cursor = cursors[index]
                if cursor.finished:
                    continue
                text, entries, token_ids = cursor.advance(completion)
                logprobs = self._logprobs(entries) if entries else None
                if shaping:
                    events = outputs[index].feed(text)
                    if completion.finish_reason is not None:
                        events += outputs[index].finish()
                    deltas = builders[index].deltas(events)
                else:
                    deltas = [{"content": text}] if text else []
                if not deltas and (logprobs or (self.return_token_ids and token_ids)):
                    deltas = [{"content": ""}]
                for i, delta in enumerate(deltas):
                    choice = {"index": index, "delta": delta, "logprobs": logprobs if i == 0 else None,
                              "finish_reason": None}
                    if self.return_token_ids:
                        choice["token_ids"] = token_ids if i == 0 else []
                    yield self._chunk([choice], include_usage)
                if completion.finish_reason is not None:
                    cursor.finished = True
                    yield self._chunk([{"index": index, "delta": {}, "logprobs": None,
                                        "finish_reason": finish_reason(completion.finish_reason,
                                                                       builders[index].calls > 0),
                                        "stop_reason": completion.stop_reason}], include_usage)
        if include_usage and last is not None:
            yield self._chunk([], True, usage(len(last.prompt_token_ids),
                                              sum(len(c.token_ids) for c in last.outputs)))
        yield SSE_DONE
