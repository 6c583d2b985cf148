"""Each --tool-call-parser against transcripts in its family's real output format, fed whole and in
random chunk splits (the streamed events must equal the whole-text ones): text before and after
calls, several calls, and malformed calls, which stay content."""

from __future__ import annotations

import json

import pytest

from parser_streams import check_streams
from metrale.entrypoints.parsers import TOOL_CALL_PARSER_NAMES
from metrale.entrypoints.parsers.deepseek_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from metrale.entrypoints.parsers.registry import TOOL_CALL_PARSERS, tool_call_parser
from metrale.entrypoints.parsers.tool_calls import FunctionSpec, ToolCall

WEATHER = FunctionSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "unit": {"enum": ["celsius", "fahrenheit"]}, "hours": {"type": "array", "items": {"type": "integer"}}},
    "required": ["city"]})
WRITE = FunctionSpec("write_file", {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "options": {"type": "object"}}})
NOW = FunctionSpec("get_time", {})
FUNCTIONS = [WEATHER, WRITE, NOW]

CODE = 'def add(a, b):\n    """Sum."""\n    return a + b\n'


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def parse(parser: str, text: str) -> list:
    return check_streams(lambda: tool_call_parser(parser, FUNCTIONS), text)


def test_every_vllm_name_has_a_parser():
    assert tuple(TOOL_CALL_PARSERS) == TOOL_CALL_PARSER_NAMES


# -- hermes (Hermes 2 Pro, Qwen2.5, Qwen3) ---------------------------------------------------------

def hermes_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


@pytest.mark.parametrize("text,expected", [
    (hermes_call("get_weather", {"city": "Paris"}), [call("get_weather", city="Paris")]),
    ("I'll check both cities.\n\n" + hermes_call("get_weather", {"city": "Paris"}) + "\n"
     + hermes_call("get_weather", {"city": "東京", "days": 3}),
     ["I'll check both cities.", call("get_weather", city="Paris"), call("get_weather", city="東京", days=3)]),
    (hermes_call("get_time", {}) + "\nThat is all I need.", [call("get_time"), "That is all I need."]),
    ('<tool_call>\n{"arguments": {"path": "a.py", "content": ' + json.dumps(CODE) + '}, "name": "write_file"}\n'
     '</tool_call>', [call("write_file", path="a.py", content=CODE)]),
    # arguments sent as a JSON string, and no arguments at all
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
     '<tool_call>{"name": "get_time"}</tool_call>', [call("get_weather", city="Rome"), call("get_time")]),
    # the text says "<tool_call>" before the real call: the stray marker stays prose
    ("Calls go in <tool_call> tags:\n" + hermes_call("get_time", {}), ["Calls go in <tool_call> tags:", call("get_time")]),
    ("No call here: 1 < 2, <b>bold</b>, <tool_calls> and <tool_", ["No call here: 1 < 2, <b>bold</b>, <tool_calls> and <tool_"]),
])
def test_hermes(text, expected):
    assert parse("hermes", text) == expected


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # a brace short
    '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',  # not an offered function
    '<tool_call>\n{"name": "get_weather", "arguments": ["Paris"]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut off: never closed
    '<tool_call>\nget_weather(city="Paris")\n</tool_call>',
])
def test_hermes_malformed_calls_stay_content(text):
    assert parse("hermes", "Before. " + text) == ["Before. " + text]


def test_hermes_good_call_after_a_malformed_one():
    bad = '<tool_call>{"name": "get_weather"</tool_call>'
    assert parse("hermes", bad + "\n" + hermes_call("get_time", {})) == [bad, call("get_time")]


# -- qwen3_coder (Qwen3-Coder, Qwen3.5) -----------------------------------------------------------

def coder_call(name: str, **parameters) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize("text,expected", [
    (coder_call("get_weather", city="Paris", days="3", metric="true", unit="celsius", hours="[9, 12]"),
     [call("get_weather", city="Paris", days=3, metric=True, unit="celsius", hours=[9, 12])]),
    # a string parameter stays as written, even when it looks like JSON; code keeps its newlines
    ("Writing it now.\n" + coder_call("write_file", path="42", content=CODE) + "\n" + coder_call("get_time"),
     ["Writing it now.", call("write_file", path="42", content=CODE), call("get_time")]),
    # a value of the wrong type stays the text the model wrote; an object parameter is read as JSON
    (coder_call("get_weather", city="Oslo", days="several") + coder_call("write_file", options='{"mode": 420}'),
     [call("get_weather", city="Oslo", days="several"), call("write_file", options={"mode": 420})]),
])
def test_qwen3_coder(text, expected):
    assert parse("qwen3_coder", text) == expected


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # no </function>
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",  # no </parameter>
    "<tool_call>\n<function=send_email>\n</function>\n</tool_call>",  # unknown function
    "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",  # text outside a parameter
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>\n"
    "</function>\n</tool_call>",  # a parameter twice
])
def test_qwen3_coder_malformed_calls_stay_content(text):
    assert parse("qwen3_coder", text) == [text]


# -- glm45 (GLM-4.5, 4.6: newlines between the parts; GLM-4.7, GLM-5: none) -------------------------

@pytest.mark.parametrize("text,expected", [
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>2</arg_value>\n</tool_call>", [call("get_weather", city="Beijing", days=2)]),
    ("Let me look.\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>上海</arg_value><arg_key>hours</arg_key>"
     "<arg_value>[8, 20]</arg_value></tool_call><tool_call>get_time</tool_call>",
     ["Let me look.", call("get_weather", city="上海", hours=[8, 20]), call("get_time")]),
    ('<tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value>{"not": "parsed"}</arg_value>\n<arg_key>options'
     '</arg_key>\n<arg_value>{"mode": 420}</arg_value>\n</tool_call>',
     [call("write_file", path='{"not": "parsed"}', options={"mode": 420})]),
])
def test_glm45(text, expected):
    assert parse("glm45", text) == expected


@pytest.mark.parametrize("text", [
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>",  # a key without a value
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\n</tool_call>",
    "<tool_call>get weather\n</tool_call>",
    "<tool_call>\n</tool_call>",
])
def test_glm45_malformed_calls_stay_content(text):
    assert parse("glm45", text) == [text]


# -- minimax_m2 -------------------------------------------------------------------------------------

def test_minimax_m2_one_block_several_invokes():
    text = ('I will fetch both.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
            '</parameter>\n<parameter name="days">5</parameter>\n</invoke>\n<invoke name="write_file">\n'
            '<parameter name="path">notes.txt</parameter>\n<parameter name="content">' + CODE + '</parameter>\n'
            '</invoke>\n</minimax:tool_call>')
    assert parse("minimax_m2", text) == ["I will fetch both.", call("get_weather", city="Paris", days=5),
                                         call("write_file", path="notes.txt", content=CODE)]


@pytest.mark.parametrize("text", [
    '<minimax:tool_call>\n<invoke name="get_weather>\n</invoke>\n</minimax:tool_call>',
    '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</invoke>\n</minimax:tool_call>',
    '<minimax:tool_call>\n<invoke name="get_weather">\n</invoke>\n<invoke name="nope">\n</invoke>\n'
    '</minimax:tool_call>',  # one bad invoke: the block is not a call
])
def test_minimax_m2_malformed_calls_stay_content(text):
    assert parse("minimax_m2", text + "\nafter") == [text + "\nafter"]


# -- deepseek_v3 (V3's fenced form; V3.1's plain one) -------------------------------------------------

def test_deepseek_v3_fenced_calls():
    text = ("Checking.\n" + CALLS_BEGIN + CALL_BEGIN + "function" + SEP + 'get_weather\n```json\n{"city": "Hanoi"}\n```'
            + CALL_END + "\n" + CALL_BEGIN + "function" + SEP + "get_time\n```json\n{}\n```" + CALL_END + CALLS_END)
    assert parse("deepseek_v3", text) == ["Checking.", call("get_weather", city="Hanoi"), call("get_time")]


def test_deepseek_v31_plain_calls():
    text = CALLS_BEGIN + CALL_BEGIN + 'get_weather' + SEP + '{"city": "Lima", "days": 1}' + CALL_END + CALLS_END
    assert parse("deepseek_v3", text) == [call("get_weather", city="Lima", days=1)]


@pytest.mark.parametrize("item", [
    "function" + SEP + 'get_weather\n```json\n{"city": "Hanoi"\n```',  # bad JSON
    "function" + SEP + 'get_weather\n{"city": "Hanoi"}',  # V3 without its fence
    "tool" + SEP + 'get_weather\n```json\n{}\n```',
    "unknown_fn" + SEP + "{}",
])
def test_deepseek_v3_malformed_calls_stay_content(item):
    text = CALLS_BEGIN + CALL_BEGIN + item + CALL_END + CALLS_END
    assert parse("deepseek_v3", text) == [text]


# -- fuzz: any mix of the formats' pieces parses without error, the same however it is streamed ------

PIECES = ["<tool_call>", "</tool_call>", "<function=get_weather>", "</function>", "<parameter=city>",
          "</parameter>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<minimax:tool_call>",
          "</minimax:tool_call>", '<invoke name="get_time">', "</invoke>", '<parameter name="city">', CALLS_BEGIN,
          CALLS_END, CALL_BEGIN, CALL_END, SEP, "function", "get_weather", "get_time", '{"name": "get_time"}',
          '{"city": "Oslo"}', "```json\n", "```", "\n", " ", "<", ">", '"', "{", "}", "x", "é", "🙂"]


@pytest.mark.parametrize("parser", TOOL_CALL_PARSER_NAMES)
def test_random_mixes_of_markers(parser):
    import random

    rng = random.Random(parser)
    for _ in range(40):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40)))
        events = check_streams(lambda: tool_call_parser(parser, FUNCTIONS), text, seeds=3)
        content = "".join(e for e in events if isinstance(e, str))
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert all(json.loads(c.arguments) is not None for c in calls)
        if not calls:
            assert content == text  # nothing is lost: without calls, the text is the content
