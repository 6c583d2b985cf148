"""From a request's tools and tool_choice to the reply's message and deltas: the plan, the
composition of reasoning and tool parsing, forced calls, and streamed == non-streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from parser_streams import random_chunks
from metrale.entrypoints.parsers.forced_calls import NamedCallParser, RequiredCallsParser
from metrale.entrypoints.parsers.tool_calls import FunctionSpec, ToolCall, ToolCallArguments, ToolCallStart
from metrale.entrypoints.server.assistant_output import DeltaBuilder, MessageBuilder, finish_reason, plan_output
from metrale.entrypoints.server.errors import APIError
from metrale.entrypoints.server.protocol import ChatCompletionRequest
from metrale.entrypoints.server.structured_outputs import tool_call_structured_outputs

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather?"}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


def plan(reasoning=None, parser="hermes", auto=True, **fields):
    return plan_output(request(**fields), reasoning, parser, auto)


def message_of(output_plan, text: str, prompt: str = "") -> dict:
    choice, builder = output_plan.choice(prompt), MessageBuilder(output_plan)
    builder.add(choice.feed(text))
    builder.add(choice.finish())
    return builder.message()


def streamed_message(output_plan, chunks: list[str], prompt: str = "") -> dict:
    """Deltas as the server streams them, folded back as a client does."""
    choice, deltas = output_plan.choice(prompt), DeltaBuilder()
    message = {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
    for i, chunk in enumerate(chunks + [None]):
        events = choice.finish() if chunk is None else choice.feed(chunk)
        for delta in deltas.deltas(events):
            message["content"] += delta.get("content", "")
            message["reasoning_content"] += delta.get("reasoning_content", "")
            for piece in delta.get("tool_calls", []):
                if piece["index"] == len(message["tool_calls"]):
                    message["tool_calls"].append(json.loads(json.dumps(piece)))
                else:
                    message["tool_calls"][piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    return message


def without_ids(message: dict) -> dict:
    calls = [{k: v for k, v in c.items() if k not in ("id", "index")} for c in message.get("tool_calls") or []]
    return {"content": message["content"] or None, "reasoning": message.get("reasoning_content") or None,
            "calls": calls}


def test_plan_resolves_tool_choice_as_openai():
    assert plan(tools=[WEATHER]).tool_mode == "auto"  # tools without tool_choice: auto
    assert plan().tool_mode == "none" and plan(tool_choice="auto").tool_mode == "none"  # auto without tools
    assert plan(tools=[WEATHER], tool_choice="none").tool_mode == "none"
    named = plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.tool_mode == "named" and named.named.name == "get_time" and named.forces_calls
    required = plan("qwen3", tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert required.forces_calls and not required.parallel_tool_calls
    assert required.reasoning_parser is None  # the grammar holds the whole output: no reasoning in it
    assert plan(tools=[WEATHER]).template_tools == [WEATHER]


@pytest.mark.parametrize("fields,auto,param", [
    ({"tools": [WEATHER]}, False, "tools"),  # auto by default, but the server has no parser
    ({"tools": [WEATHER], "tool_choice": "auto"}, False, "tool_choice"),
    ({"tool_choice": "required"}, True, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, True, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, True, "tools"),
])
def test_plan_refusals(fields, auto, param):
    with pytest.raises(APIError) as error:
        plan(auto=auto, **fields)
    assert error.value.status == 400 and error.value.param == param


QWEN3_PROMPT = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_OUTPUT = ('<think>\nTwo cities: two calls.\n</think>\n\nChecking both.\n<tool_call>\n'
                '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
                '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def test_reasoning_then_calls_streamed_equals_whole():
    output_plan = plan("qwen3", tools=[WEATHER])
    whole = message_of(output_plan, QWEN3_OUTPUT, QWEN3_PROMPT)
    assert whole["reasoning_content"] == "Two cities: two calls." and whole["content"] == "Checking both."
    assert [json.loads(c["function"]["arguments"])["city"] for c in whole["tool_calls"]] == ["Paris", "Oslo"]
    for seed in range(20):
        chunks = random_chunks(QWEN3_OUTPUT, seed)
        assert without_ids(streamed_message(output_plan, chunks, QWEN3_PROMPT)) == without_ids(whole)


def test_a_call_inside_the_reasoning_is_not_a_call():
    output_plan = plan("qwen3", tools=[WEATHER])
    text = '<think>I could write <tool_call>{"name": "get_weather", "arguments": {}}</tool_call></think>No.'
    message = message_of(output_plan, text, QWEN3_PROMPT)
    assert "tool_calls" not in message and message["content"] == "No."


def test_parallel_tool_calls_false_keeps_the_first_call():
    message = message_of(plan(tools=[WEATHER], parallel_tool_calls=False), QWEN3_OUTPUT.split("</think>")[1])
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"}]


def test_without_parsers_the_text_is_the_content():
    output_plan = plan(parser=None, auto=False)
    assert not output_plan.shapes_output
    assert message_of(plan("qwen3"), "Plain answer.") == {"role": "assistant", "content": "Plain answer.",
                                                           "reasoning_content": None}


def test_finish_reason():
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length" and finish_reason("stop", False) == "stop"


# -- forced calls --------------------------------------------------------------------------------

FUNCTIONS = [FunctionSpec("get_weather", WEATHER["function"]["parameters"]), FunctionSpec("get_time", {})]


def test_the_grammars_outputs_are_what_the_parsers_read():
    """The specs the grammar holds forced calls to (structured_outputs.tool_call_structured_outputs)
    accept exactly the outputs the forced-call parsers read as calls."""
    required = tool_call_structured_outputs([WEATHER, TIME], "required").schema()
    good = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    jsonschema.validate(json.loads(good), required)
    assert RequiredCallsParser(FUNCTIONS).parse(good) == [ToolCall("get_weather", '{"city": "Paris"}'),
                                                         ToolCall("get_time", "{}")]
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = tool_call_structured_outputs([WEATHER, TIME], "required", parallel_tool_calls=False).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(good), single)
    named = tool_call_structured_outputs([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    jsonschema.validate({"city": "Paris"}, named.schema())
    assert NamedCallParser(FUNCTIONS[0]).parse('{"city": "Paris"}') == [ToolCallStart("get_weather"),
                                                                       ToolCallArguments('{"city": "Paris"}')]


def test_required_output_parses_streamed_and_whole():
    text = ' [ {"name": "get_weather", "parameters": {"city": "Pa\\"ris}"}},\n{"name": "get_time", "parameters": {}} ]'
    expected = [ToolCall("get_weather", '{"city": "Pa\\"ris}"}'), ToolCall("get_time", "{}")]
    assert RequiredCallsParser(FUNCTIONS).parse(text) == expected
    for seed in range(20):
        parser, events = RequiredCallsParser(FUNCTIONS), []
        for chunk in random_chunks(text, seed):
            events += parser.feed(chunk)
        assert events + parser.finish() == expected
    # cut short by max_tokens: the complete call goes out, the rest is content
    cut = text.index('{"name": "get_time"') + 15
    assert RequiredCallsParser(FUNCTIONS).parse(text[:cut]) == [expected[0], '{"name": "get_t']
    assert RequiredCallsParser(FUNCTIONS).parse("not json") == ["not json"]


def test_named_output_streams_as_arguments():
    named = plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    text = '{"city": "Paris"}'
    whole = message_of(named, text)
    assert whole["content"] is None and whole["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                              "arguments": text}
    chunks = random_chunks(text, 3)
    parser = NamedCallParser(FUNCTIONS[0])
    deltas = DeltaBuilder().deltas([event for chunk in chunks for event in parser.feed(chunk)])
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len(deltas) == 1 + len(chunks)  # the header, then one arguments fragment per chunk
    assert without_ids(streamed_message(named, chunks)) == without_ids(whole)


def test_an_output_under_a_grammar_is_not_taken_for_reasoning():
    """With response_format, the grammar holds the output from its first token: an R1 prompt that
    opens <think> would otherwise make the whole JSON answer 'reasoning'."""
    r1_prompt = "<｜User｜>Give JSON<｜Assistant｜><think>\n"
    assert message_of(plan("deepseek_r1"), '{"a": 1}', r1_prompt)["content"] == ""
    assert message_of(plan("deepseek_r1").under_grammar(), '{"a": 1}', r1_prompt)["content"] == '{"a": 1}'
