"""Reliability case 12: 500 KB of adversarial tool-call and reasoning text parses within 1 s, fed
whole or streamed in token-sized chunks, and the server's event loop keeps answering meanwhile.

Times are CPU time of this process (the CI machine's two cores are shared): what is checked is
the parsers' own work, which is linear, not how busy the neighbours are."""

from __future__ import annotations

import asyncio
import time

import pytest

from metrale.entrypoints.parsers.deepseek_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from metrale.entrypoints.parsers.forced_calls import NamedCallParser, RequiredCallsParser
from metrale.entrypoints.parsers.reasoning import ReasoningParser
from metrale.entrypoints.parsers.registry import tool_call_parser
from metrale.entrypoints.parsers.tool_calls import FunctionSpec
from metrale.entrypoints.server.chat import PARSE_ON_LOOP_CHARS, _Reply
from metrale.entrypoints.server.assistant_output import OutputPlan
from metrale.messages.outputs import CompletionOutput, RequestOutput

SIZE = 500_000
FUNCTIONS = [FunctionSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "n": {"type": "integer"}}})]


def fill(unit: str, head: str = "", tail: str = "") -> str:
    """head, `unit` repeated, tail: SIZE characters in all."""
    return head + unit * ((SIZE - len(head) - len(tail)) // len(unit)) + tail


GOOD_HERMES = '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call>'
ADVERSARIAL = {
    "hermes": [
        fill("<tool_call>"), fill("<tool_call></tool_call>"), fill("<"), fill("<tool_cal"), fill(" "),
        fill("[", '<tool_call>{"name": "get_weather", "arguments": ', "</tool_call>"),  # nested past the decoder
        fill("a", '<tool_call>{"name": "'),  # never closed
        fill("\\\"", '<tool_call>{"name": "get_weather", "arguments": {"city": "', '"}}</tool_call>'),
        fill("1", '<tool_call>{"name": "get_weather", "arguments": {"n": ', "}}</tool_call>"),  # a 500K-digit int
        fill(GOOD_HERMES),  # thousands of good calls
    ],
    "qwen3_coder": [
        fill("<parameter=city>", "<tool_call><function=get_weather>", "</tool_call>"),
        fill("<function=", "<tool_call>", "</tool_call>"),
        fill("9", "<tool_call><function=get_weather><parameter=n>", "</parameter></function></tool_call>"),
        fill("<tool_call><function=get_weather><parameter=city>x</parameter></function></tool_call>"),
    ],
    "glm45": [
        fill("<arg_key>k</arg_key><arg_value>", "<tool_call>get_weather", "</tool_call>"),
        fill("<arg_key>", "<tool_call>get_weather"),
        fill("<tool_call>get_weather<arg_key>city</arg_key><arg_value>x</arg_value></tool_call>"),
    ],
    "minimax_m2": [
        fill('<invoke name="', "<minimax:tool_call>", "</minimax:tool_call>"),
        fill('<parameter name="city">', '<minimax:tool_call><invoke name="get_weather">', "</minimax:tool_call>"),
    ],
    "deepseek_v3": [
        fill(CALL_BEGIN, CALLS_BEGIN, CALLS_END),
        fill(CALL_BEGIN + "function" + SEP, CALLS_BEGIN, CALLS_END),
        fill("`", CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_weather\n", CALL_END + CALLS_END),
    ],
}
REASONING = [fill("</thin", "<think>"), fill(" "), fill("<"), fill("<think>"), fill("x", "<think>")]
REQUIRED = [fill("["), fill("{", "["), fill('\\"', '[{"name": "'), fill("[{}]", "["),
            fill('{"name": "get_weather", "parameters": {}}, ', "[", "]")]


def cpu_seconds(parse, text: str, chunk: int | None) -> float:
    started = time.process_time()
    if chunk is None:
        parse.feed(text)
    else:
        for i in range(0, len(text), chunk):
            parse.feed(text[i:i + chunk])
    parse.finish()
    return time.process_time() - started


CASES = ([(f"{name}-{i}", lambda name=name: tool_call_parser(name, FUNCTIONS), text)
          for name, texts in ADVERSARIAL.items() for i, text in enumerate(texts)]
         + [(f"reasoning-{family}-{i}", lambda family=family: ReasoningParser(family), text)
            for family in ("qwen3", "deepseek_r1") for i, text in enumerate(REASONING)]
         + [(f"required-{i}", lambda: RequiredCallsParser(FUNCTIONS), text) for i, text in enumerate(REQUIRED)]
         + [("named", lambda: NamedCallParser(FUNCTIONS[0]), fill(" x"))])


@pytest.mark.parametrize("make,text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_500kb_adversarial_text_parses_in_linear_time(make, text):
    assert len(text) >= SIZE - 100
    # CPU seconds, not wall time; linear parsing takes ~0.3-1.5 s on 2-core CI machines, where a
    # quadratic rescan of 500 KB would take minutes: 3 s tells them apart on a slow machine too.
    assert cpu_seconds(make(), text, None) < 3.0
    assert cpu_seconds(make(), text, 4) < 3.0  # streamed, a token's worth of characters at a time


def test_the_event_loop_keeps_answering_while_a_long_reply_is_parsed():
    """A non-streamed reply's text is parsed off the loop when it is long: a task that wakes every
    5 ms (a /health request's worth of work) is never held up for 100 ms."""
    text = fill("<tool_call></tool_call>")  # the slowest whole-text case: thousands of malformed blocks
    assert len(text) > PARSE_ON_LOOP_CHARS
    plan = OutputPlan(reasoning_parser="qwen3", tool_mode="auto", tool_call_parser="hermes",
                      functions=tuple(FUNCTIONS))
    reply = _Reply("chatcmpl-x", "m", None, False, plan, "<|im_start|>assistant\n")
    output = RequestOutput("chatcmpl-x", None, [1], [CompletionOutput(0, text, [2], finish_reason="stop")], True)

    async def main() -> tuple[dict, float]:
        longest, done = 0.0, asyncio.Event()

        async def ticker():
            nonlocal longest
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                longest, last = max(longest, now - last), now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        result = await reply.full_off_loop(output)
        done.set()
        await task
        return result, longest

    result, longest = asyncio.run(main())
    assert result["choices"][0]["message"]["content"] == text
    assert longest < 0.1, longest
