"""Tool calls in a model's output: the events a parser answers with, and the scanner every
marker-delimited format shares.

A parser answers each chunk of text with events, in order: `str` (content) and `ToolCall`. A call
goes out once its closing marker has arrived and its text parses; until then its text is held.
So a call that turns out malformed (bad JSON, an unknown function, no closing marker before the
output ended) is never half-sent: its text goes out as content, as the non-streamed reply has it.
Whitespace between content and a call, or between calls, is dropped.

Formats (one class each, `PARSERS` maps vLLM's `--tool-call-parser` names to them):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3);
- qwen3_coder, glm45, minimax_m2: XML-like (xml_calls.py);
- deepseek_v3: DeepSeek-V3's and V3.1's special-token format (deepseek_calls.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from metrale.entrypoints.parsers.text_scan import MarkerSearch, SpaceHolder, partial_suffix


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ToolCallStart:
    """A call whose arguments follow in ToolCallArguments events (a forced call streams so)."""

    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """A piece of the arguments of the call started last."""

    text: str


Event = str | ToolCall | ToolCallStart | ToolCallArguments


@dataclass(frozen=True)
class FunctionSpec:
    """What a parser knows of a function the request offers: its name and its parameters' schema."""

    name: str
    parameters: dict


def json_arguments(value: Any) -> str | None:
    """A parsed arguments value as the JSON text OpenAI sends, or None if it is not an object."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def load_json(text: str) -> Any:
    """json.loads, with any failure (syntax, nesting too deep for the decoder) as a ValueError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


class TaggedCallParser:
    """Content with tool calls in blocks between `open_marker` and `close_marker`.

    A subclass says what a block's body holds (`parse_block`: the calls, or None when it is not a
    well-formed call). A block runs from the last opening marker before the first closing marker,
    so stray opening markers in prose stay content. Each character is looked at a bounded number
    of times: the opening and closing markers are searched for incrementally, a block's text is
    kept in pieces and joined once, when it closes."""

    open_marker: str
    close_marker: str

    def __init__(self, functions: list[FunctionSpec]):
        self.functions = {f.name: f for f in functions}
        self._space = SpaceHolder()
        self._held = ""  # content that may be the start of an opening marker
        self._block: list[str] | None = None  # the open block's text, in pieces
        self._close = MarkerSearch(self.close_marker)

    def parse_block(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text:
            text = self._outside(text, events) if self._block is None else self._inside(text, events)
        return events

    def finish(self) -> list[Event]:
        """The end of the output: what is held goes out; an unclosed block is content."""
        events: list[Event] = []
        rest = "".join(self._block) if self._block is not None else self._held
        self._block, self._held = None, ""
        self._content(rest, events)
        tail = self._space.flush()
        if tail:
            events.append(tail)
        return events

    def parse(self, text: str) -> list[Event]:
        """The whole output at once."""
        return self.feed(text) + self.finish()

    # -- the scanner -------------------------------------------------------------------------

    def _outside(self, text: str, events: list[Event]) -> str:
        text = self._held + text
        self._held = ""
        index = text.find(self.open_marker)
        if index == -1:
            keep = partial_suffix(text, self.open_marker)
            self._content(text[:len(text) - keep], events)
            self._held = text[len(text) - keep:]
            return ""
        self._content(text[:index], events)
        self._block = [self.open_marker]
        self._close.reset()
        return text[index + len(self.open_marker):]

    def _inside(self, text: str, events: list[Event]) -> str:
        end = self._close.find(text)
        if end == -1:
            self._block.append(text)
            return ""
        self._block.append(text[:end])
        block = "".join(self._block)
        self._block = None
        self._closed_block(block, events)
        return text[end:]

    def _closed_block(self, block: str, events: list[Event]) -> None:
        start = block.rfind(self.open_marker, len(self.open_marker), len(block) - len(self.close_marker))
        if start != -1:  # an earlier opening marker had no call after it: prose
            self._content(block[:start], events)
            block = block[start:]
        calls = self.parse_block(block[len(self.open_marker):len(block) - len(self.close_marker)])
        if calls is None:
            self._content(block, events)
            return
        self._space.drop()
        self._space.strip_leading = True
        events.extend(calls)

    def _content(self, text: str, events: list[Event]) -> None:
        if text:
            out = self._space.push(text)
            if out:
                events.append(out)

    # -- helpers for subclasses --------------------------------------------------------------

    def known(self, name: str) -> bool:
        return name in self.functions


class HermesParser(TaggedCallParser):
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one call per block."""

    open_marker = "<tool_call>"
    close_marker = "</tool_call>"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        try:
            value = load_json(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not self.known(value["name"]):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models send the arguments as a JSON string
            try:
                arguments = load_json(arguments)
            except ValueError:
                return None
        text = json_arguments(arguments)
        return None if text is None else [ToolCall(value["name"], text)]


def parameter_types(schema: dict | None, name: str) -> set[str] | None:
    """The JSON types a function's parameter may take, from its schema; None if it does not say."""
    if not isinstance(schema, dict):
        return None
    properties = schema.get("properties")
    spec = properties.get(name) if isinstance(properties, dict) else None
    if not isinstance(spec, dict):
        return None
    kind = spec.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    if "enum" in spec and isinstance(spec["enum"], list) and all(isinstance(v, str) for v in spec["enum"]):
        return {"string"}
    return None


def typed_value(raw: str, types: set[str] | None) -> Any:
    """A parameter's text from an XML-like call as the JSON value its schema asks for. Strings stay
    as written; numbers, booleans, null, objects and arrays are read as JSON; text that is not the
    asked-for type stays a string (the client sees what the model wrote)."""
    if types is not None and types <= {"string"}:
        return raw
    stripped = raw.strip()
    try:
        value = load_json(stripped)
    except ValueError:
        if types and "boolean" in types and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if types and "null" in types and stripped.lower() in ("none", "null"):
            return None
        return raw
    if types is None:
        return value
    matches = {"string": isinstance(value, str), "integer": isinstance(value, int) and not isinstance(value, bool),
               "number": isinstance(value, (int, float)) and not isinstance(value, bool),
               "boolean": isinstance(value, bool), "null": value is None,
               "object": isinstance(value, dict), "array": isinstance(value, list)}
    return value if any(matches.get(t, False) for t in types) else raw


def strip_newline(value: str) -> str:
    """The templates write a parameter's value between newlines: one on each side is not part of it."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value
