"""What a chat reply says, from the model's raw text: the reasoning apart (--reasoning-parser), the
tool calls (tool_choice auto with --tool-call-parser; required and named through the grammar),
and the content left over.

`plan_output` reads a request's tools and tool_choice once and refuses what cannot be served
(a 400 naming the field). Each choice then gets a `ChoiceOutput`, which is fed the text as the
engine produces it and answers with events; the streamed reply sends them as deltas, the
non-streamed one gathers them into one message (`MessageBuilder`), so the two say the same.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field

from metrale.entrypoints.parsers.forced_calls import NamedCallParser, RequiredCallsParser
from metrale.entrypoints.parsers.reasoning import ReasoningParser
from metrale.entrypoints.parsers.registry import tool_call_parser
from metrale.entrypoints.parsers.tool_calls import (Event, FunctionSpec, ToolCall, ToolCallArguments,
                                                    ToolCallStart)
from metrale.entrypoints.server.errors import bad_request
from metrale.entrypoints.server.protocol import ChatCompletionRequest


@dataclass(frozen=True)
class Reasoning:
    """Reasoning text, apart from the content (a chunk of it when streamed)."""

    text: str


@dataclass(frozen=True)
class OutputPlan:
    """How every choice of one request is read."""

    reasoning_parser: str | None = None
    include_reasoning: bool = True
    tool_mode: str = "none"  # none | auto | required | named
    tool_call_parser: str | None = None
    functions: tuple[FunctionSpec, ...] = ()
    named: FunctionSpec | None = None
    parallel_tool_calls: bool = True
    template_tools: list[dict] | None = field(default=None, compare=False)  # what the chat template renders

    @property
    def forces_calls(self) -> bool:
        """tool_choice required or named: the grammar holds the output to the calls' schema."""
        return self.tool_mode in ("required", "named")

    @property
    def shapes_output(self) -> bool:
        return self.reasoning_parser is not None or self.tool_mode != "none"

    def under_grammar(self) -> "OutputPlan":
        """The plan for an output a grammar holds from its first token (response_format and the
        like): it has no reasoning in it, so a reasoning parser would only mistake it for some."""
        return dataclasses.replace(self, reasoning_parser=None)

    def choice(self, prompt: str) -> "ChoiceOutput":
        return ChoiceOutput(self, prompt)


def plan_output(body: ChatCompletionRequest, reasoning_parser: str | None, tool_call_parser_name: str | None,
                enable_auto_tool_choice: bool) -> OutputPlan:
    """Resolve tools and tool_choice as OpenAI does: with tools and no tool_choice, auto."""
    tools = body.tools or []
    functions = tuple(FunctionSpec(t.function.name, t.function.parameters or {}) for t in tools)
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    choice = body.tool_choice
    named = None
    if choice is None:
        mode = "auto" if tools else "none"
    elif isinstance(choice, str):
        mode = choice
    else:
        mode = "named"
        named = next((f for f in functions if f.name == choice.function.name), None)
        if named is None:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                              "tool_choice")
    if mode in ("required", "named") and not tools:
        raise bad_request(f"tool_choice {mode!r} needs tools", "tool_choice")
    if mode == "auto" and tools and not enable_auto_tool_choice:
        raise bad_request('tool_choice "auto" (the default when tools are given) needs the server started with '
                          '--enable-auto-tool-choice and --tool-call-parser; or send tool_choice "none", '
                          '"required" or a named function', "tool_choice" if choice is not None else "tools")
    if mode == "auto" and not tools:
        mode = "none"
    return OutputPlan(reasoning_parser=reasoning_parser if mode not in ("required", "named") else None,
                      include_reasoning=body.include_reasoning is not False, tool_mode=mode,
                      tool_call_parser=tool_call_parser_name if mode == "auto" else None, functions=functions,
                      named=named, parallel_tool_calls=body.parallel_tool_calls is not False,
                      template_tools=[t.model_dump(exclude_none=True) for t in tools] or None)


class ChoiceOutput:
    """One choice's text -> events: `Reasoning`, content (`str`), tool calls (`ToolCall`, or a
    `ToolCallStart` followed by `ToolCallArguments`)."""

    def __init__(self, plan: OutputPlan, prompt: str):
        self.plan = plan
        self.reasoning = ReasoningParser(plan.reasoning_parser, prompt) if plan.reasoning_parser else None
        functions = list(plan.functions)
        if plan.tool_mode == "auto":
            self.tools = tool_call_parser(plan.tool_call_parser, functions)
        elif plan.tool_mode == "required":
            self.tools = RequiredCallsParser(functions)
        elif plan.tool_mode == "named":
            self.tools = NamedCallParser(plan.named)
        else:
            self.tools = None
        self.calls = 0
        self._dropping = False  # a call after the first, with parallel_tool_calls false

    def feed(self, text: str) -> list[Event | Reasoning]:
        return self._step(text, final=False)

    def finish(self) -> list[Event | Reasoning]:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> list[Event | Reasoning]:
        events: list = []
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text) if text else ("", "")
            if final:
                more_reasoning, more_text = self.reasoning.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning and self.plan.include_reasoning:
                events.append(Reasoning(reasoning))
        if self.tools is None:
            if text:
                events.append(text)
            return events
        produced = self.tools.feed(text) if text else []
        if final:
            produced += self.tools.finish()
        for event in produced:
            if isinstance(event, (ToolCall, ToolCallStart)):
                self._dropping = self.calls >= 1 and not self.plan.parallel_tool_calls
                if self._dropping:
                    continue
                self.calls += 1
            elif isinstance(event, ToolCallArguments) and self._dropping:
                continue
            events.append(event)
        return events


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class MessageBuilder:
    """Gathers one choice's events into the non-streamed message."""

    def __init__(self, plan: OutputPlan):
        self.plan = plan
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict] = []

    def add(self, events: list) -> None:
        for event in events:
            if isinstance(event, Reasoning):
                self.reasoning.append(event.text)
            elif isinstance(event, str):
                self.content.append(event)
            elif isinstance(event, ToolCall):
                self.calls.append(_call(event.name, event.arguments))
            elif isinstance(event, ToolCallStart):
                self.calls.append(_call(event.name, ""))
            else:
                self.calls[-1]["function"]["arguments"] += event.text

    def message(self) -> dict:
        content = "".join(self.content)
        message = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.plan.reasoning_parser is not None:
            message["reasoning_content"] = "".join(self.reasoning) or None
        if self.calls:
            message["tool_calls"] = self.calls
        return message


def _call(name: str, arguments: str) -> dict:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


class DeltaBuilder:
    """Turns one choice's events into the `delta` objects of streamed chunks, OpenAI's way: a call's
    first delta carries its index, id, type and name (and empty arguments), later ones pieces of
    the arguments."""

    def __init__(self) -> None:
        self.calls = 0

    def deltas(self, events: list) -> list[dict]:
        out = []
        for event in events:
            if isinstance(event, Reasoning):
                out.append({"reasoning_content": event.text})
            elif isinstance(event, str):
                out.append({"content": event})
            elif isinstance(event, (ToolCall, ToolCallStart)):
                index, self.calls = self.calls, self.calls + 1
                out.append({"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                            "function": {"name": event.name, "arguments": ""}}]})
                if isinstance(event, ToolCall) and event.arguments:
                    out.append(self._arguments(event.arguments))
            elif event.text:
                out.append(self._arguments(event.text))
        return out

    def _arguments(self, text: str) -> dict:
        return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": text}}]}


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's finish reason: a turn that ended on its own after calling tools ends in tool_calls."""
    return "tool_calls" if reason == "stop" and made_calls else reason
