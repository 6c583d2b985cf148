"""tool_call_structured_outputs: the grammar of tool_choice "required" and named calls."""

import json

import pytest

from metrale.entrypoints.server.errors import APIError
from metrale.entrypoints.server.structured_outputs import tool_call_structured_outputs
from metrale.structured.grammars import GrammarCache

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city", "unit"], "$defs": {"unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/definitions/zone"}}, "required": ["zone"],
    "definitions": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny byte-level BPE tokenizer of the test checkpoints (384 tokens)."""
    from checkpoints import make_tokenizer

    return make_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


def _accepts(grammars, spec, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammars.compile(spec))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarCache(tokenizer, len(tokenizer))


def test_required_calls(grammars):
    spec = tool_call_structured_outputs([WEATHER, TIME, NOARGS], "required")
    call = [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}},
            {"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "ping", "parameters": {}}]
    assert _accepts(grammars, spec, json.dumps(call))
    jsonschema.validate(call, spec.schema())
    assert not _accepts(grammars, spec, "[]")
    assert not _accepts(grammars, spec, json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo",
                                                                                          "unit": "K"}}]))
    assert not _accepts(grammars, spec, json.dumps([{"name": "nope", "parameters": {}}]))
    single = tool_call_structured_outputs([WEATHER, TIME], "required", parallel_tool_calls=False)
    assert not _accepts(grammars, single, json.dumps(call[:2]))
    assert _accepts(grammars, single, json.dumps(call[1:2]))


def test_named_call_and_refusals(grammars):
    spec = tool_call_structured_outputs([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert _accepts(grammars, spec, '{"zone": "UTC"}') and not _accepts(grammars, spec, '{"zone": "utc"}')
    assert tool_call_structured_outputs([WEATHER], "auto") is None
    assert tool_call_structured_outputs([WEATHER], "none") is None
    for tools, choice in (([WEATHER], {"type": "function", "function": {"name": "missing"}}), ([], "required")):
        with pytest.raises(APIError) as e:
            tool_call_structured_outputs(tools, choice)
        assert e.value.status == 400 and e.value.param == "tool_choice"
