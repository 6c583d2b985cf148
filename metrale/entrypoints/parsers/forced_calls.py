"""Tool calls the request forces (`tool_choice: "required"` or a named function): the parsers of
the output the grammar holds to the functions' schemas (entrypoints/server/structured_outputs.py,
`tool_call_structured_outputs`, builds that grammar's spec):

- named: the output is the function's arguments object itself, so it streams as it is generated:
  the call's header first, then each piece of text as an arguments fragment;
- required: the output is `[{"name": ..., "parameters": {...}}, ...]` (at least one call; one at
  most without parallel tool calls), and each call goes out when its element of the array closes.

The grammar makes the output well-formed; text that is not (a run cut short by max_tokens, or a
server without the grammar) goes out as content from the first character that does not fit.
"""

from __future__ import annotations

import re

from metrale.entrypoints.parsers.text_scan import SpaceHolder
from metrale.entrypoints.parsers.tool_calls import (Event, FunctionSpec, ToolCall, ToolCallArguments, ToolCallStart,
                                                    json_arguments, load_json)


class NamedCallParser:
    def __init__(self, function: FunctionSpec):
        self.name = function.name
        self._started = False
        self._space = SpaceHolder()
        self._space.strip_leading = True

    def feed(self, text: str) -> list[Event]:
        piece = self._space.push(text)
        if not piece:
            return []
        events = [] if self._started else [ToolCallStart(self.name)]
        self._started = True
        return events + [ToolCallArguments(piece)]

    def finish(self) -> list[Event]:
        events = [] if self._started else [ToolCallStart(self.name)]
        self._started = True
        return events

    def parse(self, text: str) -> list[Event]:
        return self.feed(text) + self.finish()


_JSON_SPECIAL = re.compile(r'["\\{}\[\]]')


class RequiredCallsParser:
    def __init__(self, functions: list[FunctionSpec]):
        self.functions = {f.name: f for f in functions}
        self._state = "start"  # start -> array <-> element -> done; or content (not the expected JSON)
        self._element: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        pos = 0
        while pos < len(text):
            if self._state in ("done", "content"):
                events.append(text[pos:])
                break
            if self._state == "element":
                pos = self._scan_element(text, pos, events)
                continue
            pos = self._skip(text, pos, "," if self._state == "array" else "")
            if pos == len(text):
                break
            char = text[pos]
            if self._state == "start":
                self._state = "array" if char == "[" else "content"
                pos += char == "["
            elif char == "]":
                self._state, pos = "done", pos + 1
            elif char == "{":
                self._state, self._depth, self._in_string, self._escaped = "element", 0, False, False
            else:
                self._state = "content"
        return [e for e in events if e]

    def finish(self) -> list[Event]:
        if self._state == "element":  # cut short inside a call
            self._state = "content"
            return ["".join(self._element)]
        return []

    def parse(self, text: str) -> list[Event]:
        return self.feed(text) + self.finish()

    @staticmethod
    def _skip(text: str, pos: int, separators: str) -> int:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        return pos

    def _scan_element(self, text: str, pos: int, events: list[Event]) -> int:
        """Follow one element (strings, escapes, nesting) to its closing brace; returns where
        scanning stopped. Only the characters that matter to JSON's structure are visited."""
        start = pos
        while True:
            if self._escaped:
                if pos >= len(text):
                    break
                self._escaped = False
                pos += 1
                continue
            match = _JSON_SPECIAL.search(text, pos)
            if match is None:
                pos = len(text)
                break
            pos, char = match.end(), match.group()
            if self._in_string:
                if char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._element.append(text[start:pos])
                    element, self._element = "".join(self._element), []
                    self._state = "array"
                    events.extend(self._call(element))
                    return pos
        self._element.append(text[start:pos])
        return pos

    def _call(self, element: str) -> list[Event]:
        try:
            value = load_json(element)
        except ValueError:
            return [element]
        if not isinstance(value, dict) or value.get("name") not in self.functions:
            return [element]
        arguments = json_arguments(value.get("parameters", {}))
        return [element] if arguments is None else [ToolCall(value["name"], arguments)]
