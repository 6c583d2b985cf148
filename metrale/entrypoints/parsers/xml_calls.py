"""The XML-like tool-call formats, where each parameter is its own element and its value is text
(read as JSON where the function's schema asks for a number, boolean, object or array):

- qwen3_coder (Qwen3-Coder, Qwen3.5):
  `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
- glm45 (GLM-4.5 and 4.6 put newlines between the parts, GLM-4.7 and GLM-5 none):
  `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>`
- minimax_m2: `<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE</parameter>\\n
  </invoke>\\n</minimax:tool_call>`, several invokes to a block.

Bodies are read left to right with str.find, so parsing is linear in the block's length.
"""

from __future__ import annotations

import json
import re

from metrale.entrypoints.parsers.tool_calls import (TaggedCallParser, ToolCall, parameter_types, strip_newline,
                                                    typed_value)


_SPACE = re.compile(r"\s*")  # one greedy class: linear, no backtracking


class _Reader:
    """A left-to-right reader of one block's body; each method answers None when the text is not
    what the format expects there."""

    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    def skip_space(self) -> None:
        self.pos = _SPACE.match(self.text, self.pos).end()

    def at_end(self) -> bool:
        self.skip_space()
        return self.pos >= len(self.text)

    def take(self, literal: str) -> bool:
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def until(self, literal: str) -> str | None:
        """The text up to `literal`, which is consumed too."""
        end = self.text.find(literal, self.pos)
        if end == -1:
            return None
        value = self.text[self.pos:end]
        self.pos = end + len(literal)
        return value


def _name_ok(name: str | None) -> bool:
    return bool(name) and not any(c.isspace() or c in "<>\"" for c in name)


class _XmlCallParser(TaggedCallParser):
    value_newlines = False  # the family's template writes each value between newlines

    def _call(self, name: str, pairs: list[tuple[str, str]]) -> ToolCall | None:
        if not self.known(name):
            return None
        schema = self.functions[name].parameters
        arguments = {}
        for key, raw in pairs:
            if not key or key in arguments:
                return None
            raw = strip_newline(raw) if self.value_newlines else raw
            arguments[key] = typed_value(raw, parameter_types(schema, key))
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


class _InvocationParser(_XmlCallParser):
    """Blocks of one or more invocations, each a name and named parameters between markers:
    {call_open}NAME{name_end} ({param_open}KEY{name_end}VALUE{param_close})* {call_close}."""

    call_open: str
    call_close: str
    param_open: str
    name_end: str
    param_close = "</parameter>"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        reader, calls = _Reader(body), []
        while not reader.at_end():
            if not reader.take(self.call_open):
                return None
            name = reader.until(self.name_end)
            if not _name_ok(name):
                return None
            pairs = []
            while True:
                reader.skip_space()
                if reader.take(self.call_close):
                    break
                if not reader.take(self.param_open):
                    return None
                key = reader.until(self.name_end)
                value = reader.until(self.param_close) if key is not None else None
                if value is None or not _name_ok(key):
                    return None
                pairs.append((key, value))
            call = self._call(name, pairs)
            if call is None:
                return None
            calls.append(call)
        return calls or None


class Qwen3CoderParser(_InvocationParser):
    open_marker = "<tool_call>"
    close_marker = "</tool_call>"
    value_newlines = True
    call_open, name_end, call_close, param_open = "<function=", ">", "</function>", "<parameter="


class Glm45Parser(_XmlCallParser):
    open_marker = "<tool_call>"
    close_marker = "</tool_call>"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        end = body.find("<arg_key>")
        name = (body if end == -1 else body[:end]).strip()
        if not _name_ok(name):
            return None
        reader = _Reader(body)
        reader.pos = len(body) if end == -1 else end
        pairs = []
        while not reader.at_end():
            if not reader.take("<arg_key>"):
                return None
            key = reader.until("</arg_key>")
            reader.skip_space()
            if key is None or not reader.take("<arg_value>"):
                return None
            value = reader.until("</arg_value>")
            if value is None:
                return None
            pairs.append((key.strip(), value))
        call = self._call(name, pairs)
        return None if call is None else [call]


class MiniMaxM2Parser(_InvocationParser):
    open_marker = "<minimax:tool_call>"
    close_marker = "</minimax:tool_call>"
    call_open, name_end, call_close, param_open = '<invoke name="', '">', "</invoke>", '<parameter name="'
