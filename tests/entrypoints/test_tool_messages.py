"""Past tool calls and tool results reach chat templates in the shapes families' templates read:
arguments as a mapping (GLM, MiniMax, Qwen3-Coder: `arguments.items()`, `| tojson`), and for a
template that refuses a mapping (DeepSeek: `'<sep>' + arguments`) the JSON text the client sent."""

from __future__ import annotations

import asyncio
import tempfile

import pytest

from metrale.entrypoints.server.errors import APIError
from metrale.entrypoints.server.prompts import PromptRenderer, messages_for_template
from metrale.entrypoints.server.protocol import ChatMessage

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
CONVERSATION = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]

# The parts of the families' templates that render a past call and its result, written for this test.
DEEPSEEK_STYLE = ("{% for m in messages %}{% if m.role == 'assistant' %}{% for t in m.tool_calls %}"
                  "<｜tool▁call▁begin｜>{{ t.function.name + '<｜tool▁sep｜>' + t.function.arguments }}"
                  "<｜tool▁call▁end｜>{% endfor %}{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}"
                  "<｜tool▁output▁end｜>{% endif %}{% endfor %}")
GLM_STYLE = ("{% for m in messages %}{% if m.role == 'assistant' %}{% for t in m.tool_calls %}<tool_call>"
             "{{ t.function.name }}{% for k, v in t.function.arguments.items() %}<arg_key>{{ k }}</arg_key>"
             "<arg_value>{{ v | tojson if v is not string else v }}</arg_value>{% endfor %}</tool_call>{% endfor %}"
             "{% elif m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>{% endif %}"
             "{% endfor %}")
QWEN_STYLE = ("{% for m in messages %}{% for t in m.tool_calls or [] %}{\"name\": \"{{ t.function.name }}\", "
              "\"arguments\": {{ t.function.arguments if t.function.arguments is string else "
              "t.function.arguments | tojson }}}{% endfor %}{% if m.role == 'tool' %}[{{ m.tool_call_id }}]"
              "{% endif %}{% endfor %}")


def render(template: str, conversation=CONVERSATION) -> str:
    """As the server renders: a tokenizer's apply_chat_template, retried with the arguments as text."""
    from checkpoints import make_tokenizer

    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = make_tokenizer(tempfile.mkdtemp())
    _TOKENIZER.chat_template = template
    renderer = PromptRenderer([_TOKENIZER, _TOKENIZER], 1000, 10_000)
    try:
        text, _ = asyncio.run(renderer.render_chat([ChatMessage.model_validate(m) for m in conversation], False))
    finally:
        renderer.close()
    return text


_TOKENIZER = None


def test_deepseek_style_concatenates_the_json_text():
    assert render(DEEPSEEK_STYLE) == ('<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}'
                                      '<｜tool▁call▁end｜><｜tool▁output▁begin｜>18 C<｜tool▁output▁end｜>')


def test_glm_style_walks_the_mapping():
    assert render(GLM_STYLE) == ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
                                 "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
                                 "<|observation|><tool_response>18 C</tool_response>")


def test_qwen_style_and_arguments_that_are_not_an_object():
    assert render(QWEN_STYLE) == '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}[call_1]'
    odd = [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "not json"}}]}]
    assert render(QWEN_STYLE, odd) == '{"name": "f", "arguments": not json}'


def test_only_assistants_carry_tool_calls():
    with pytest.raises(APIError) as error:
        messages_for_template([ChatMessage.model_validate({"role": "user", "content": "x", "tool_calls": [CALL]})])
    assert error.value.param == "messages[0].tool_calls"
