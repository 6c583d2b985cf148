"""From cumulative engine outputs to what a response says: deltas, usage, failures.

RequestOutput text and token ids are cumulative, and text that could begin a stop string is
held back until it is known not to be one, so the visible text only ever grows: a delta is
the text past what was already sent.
"""

from __future__ import annotations

from metrale.engine.async_engine import RequestAbortedError
from metrale.messages.outputs import CompletionOutput, RequestOutput
from metrale.entrypoints.server.errors import APIError


class ChoiceCursor:
    """What one choice has sent so far."""

    def __init__(self) -> None:
        self.chars = 0
        self.tokens = 0
        self.offset = 0  # characters before the next token (legacy completions' text_offset)
        self.finished = False

    def advance(self, completion: CompletionOutput) -> tuple[str, list | None, list[int]]:
        """New text, the logprob entries and the ids of the new tokens since the last call."""
        text = completion.text[self.chars:]
        self.chars = max(self.chars, len(completion.text))
        entries = completion.logprobs[self.tokens:] if completion.logprobs is not None else None
        token_ids = completion.token_ids[self.tokens:]
        self.tokens = len(completion.token_ids)
        return text, entries, token_ids


def check_output(output: RequestOutput) -> None:
    """Raise for a request the engine ended without an answer."""
    for completion in output.outputs:
        if completion.finish_reason == "error":
            raise APIError(400, f"the engine could not serve the request: {output.error or 'unknown error'}")
        if completion.finish_reason == "abort":
            raise RequestAbortedError("the request was aborted")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_of(outputs: list[RequestOutput]) -> dict:
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(len(c.token_ids) for o in outputs for c in o.outputs))


async def final_output(stream) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    check_output(final)
    return final
