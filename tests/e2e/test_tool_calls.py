"""Tool calls and reasoning through a real `met serve` and the official `openai` client.

The model is scripted (tests/scripted_checkpoint.py): after the generation prompt of a
Qwen3-style chat template it writes `<think>...</think>` and a hermes `<tool_call>`, token by
token, as a real Qwen3 would; with `enable_thinking: false` the template closes the think block
in the prompt and the model writes the call alone. The server knows nothing of this: what is
tested is the template rendering (tools, past calls, tool results, chat_template_kwargs), the
engine's generation and detokenization, the parsers, and both reply shapes.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from server_process import ServerProcess
from scripted_checkpoint import QWEN3_STYLE_TEMPLATE, make_scripted_checkpoint

pytestmark = pytest.mark.slow

REASONING = "The user wants the weather in Paris."
CALL_TEXT = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
SCRIPT = ["<think>", f"\n{REASONING}\n", "</think>", "\n\n", "<tool_call>", CALL_TEXT, "</tool_call>"]
RAW_OUTPUT = "".join(SCRIPT)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    checkpoint = make_scripted_checkpoint(str(root / "model"), {"<|im_start|>assistant\n": SCRIPT},
                                          QWEN3_STYLE_TEMPLATE)
    process = ServerProcess(checkpoint, str(root / "serve.log"), "--reasoning-parser", "qwen3",
                            "--tool-call-parser", "hermes", "--enable-auto-tool-choice").wait_ready()
    yield process
    assert process.stop() == 0, process.log()


def create(server: ServerProcess, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 32, **kwargs}
    return server.client().chat.completions.create(model=server.client().models.list().data[0].id, **kwargs)


def gather_stream(chunks) -> dict:
    """A streamed reply folded back into one message, checking OpenAI's delta shapes on the way."""
    reasoning, content, calls, finishes = [], [], [], []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        content.append(delta.content or "")
        for piece in delta.tool_calls or []:
            if piece.index == len(calls):  # a call's first delta: id, type and name
                assert piece.id and piece.type == "function" and piece.function.name
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": piece.function.arguments or ""})
            else:
                assert piece.index == len(calls) - 1 and piece.id is None and piece.function.name is None
                calls[-1]["arguments"] += piece.function.arguments
    return {"reasoning": "".join(reasoning) or None, "content": "".join(content) or None, "calls": calls,
            "finish_reasons": finishes}


def test_auto_tool_call(server):
    reply = create(server, messages=ASK, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == REASONING
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert reply.usage.completion_tokens == len(SCRIPT) + 1  # the script's tokens and the end of sequence

    streamed = gather_stream(create(server, messages=ASK, tools=TOOLS, stream=True))
    assert streamed["finish_reasons"] == ["tool_calls"]
    assert streamed["reasoning"] == REASONING and streamed["content"] is None
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [("get_weather", call.function.arguments)]


def test_chat_template_kwargs_reach_the_template(server):
    """enable_thinking false: the template closes <think> in the prompt; the model writes the call
    alone, and the parser knows from the prompt that no reasoning comes."""
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    reply = create(server, messages=ASK, tools=TOOLS, extra_body=kwargs)
    choice = reply.choices[0]
    assert choice.message.model_extra["reasoning_content"] is None and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert reply.usage.completion_tokens == 4  # <tool_call>, the call, </tool_call>, end of sequence

    bad = {"chat_template_kwargs": {"tools": []}}
    with pytest.raises(openai.BadRequestError) as error:
        create(server, messages=ASK, extra_body=bad)
    assert error.value.body["param"] == "chat_template_kwargs"


def test_tool_choice_none_leaves_the_text(server):
    reply = create(server, messages=ASK, tools=TOOLS, tool_choice="none")
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "<tool_call>" + CALL_TEXT + "</tool_call>"
    assert choice.message.model_extra["reasoning_content"] == REASONING


def test_tool_results_round_trip_through_the_template(server):
    past_call = {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conversation = ASK + [{"role": "assistant", "content": None, "tool_calls": [past_call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    reply = create(server, messages=conversation, tools=TOOLS)
    assert reply.choices[0].finish_reason == "tool_calls"

    http = httpx.Client(base_url=server.url, timeout=30)
    tokens = http.post("/tokenize", json={"messages": conversation, "tools": TOOLS}).json()["tokens"]
    assert reply.usage.prompt_tokens == len(tokens)
    prompt = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C and sunny\n</tool_response><|im_end|>'
            in prompt)
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS + TOOLS}, "tools"),
    ({"messages": [{"role": "user", "tool_calls": [], "content": "x"}, {"role": "tool", "content": 5}]},
     "messages[1].content"),
])
def test_bad_tool_requests_are_400(server, fields, param):
    body = {"messages": ASK, "tools": TOOLS, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# -- forced calls: the grammar holds the output to the functions' schemas --------------------------

FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {"when": {"enum": ["now", "later"]}}, "required": ["when"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (FORECAST, ALARM)}


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_forecast"}}, "required"])
def test_forced_calls_follow_the_schema(server, tool_choice):
    for seed in range(3):
        fields = dict(messages=ASK, tools=[FORECAST, ALARM], tool_choice=tool_choice, temperature=1.0, seed=seed,
                      max_tokens=200, parallel_tool_calls=False)
        choice = create(server, **fields).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        check_call(call.function.name, call.function.arguments)
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_forecast"
        streamed = gather_stream(create(server, stream=True, **fields))
        assert streamed["finish_reasons"] == ["tool_calls"] and streamed["content"] is None
        assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [(call.function.name,
                                                                              call.function.arguments)]


def test_a_schema_the_grammar_cannot_take_is_400(server):
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}
    with pytest.raises(openai.BadRequestError) as error:
        create(server, messages=ASK, tools=[broken], tool_choice="required")
    assert error.value.body["param"] == "tool_choice"
    assert create(server, messages=ASK, tools=TOOLS).choices[0].finish_reason == "tool_calls"  # still serving


def test_forced_call_with_response_format_is_refused(server):
    with pytest.raises(openai.BadRequestError) as error:
        create(server, messages=ASK, tools=[FORECAST], tool_choice="required",
               response_format={"type": "json_object"})
    assert error.value.body["param"] == "tool_choice"
