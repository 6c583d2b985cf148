"""vLLM's parser names -> met's parsers."""

from __future__ import annotations

from metrale.entrypoints.parsers import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES
from metrale.entrypoints.parsers.deepseek_calls import DeepSeekV3Parser
from metrale.entrypoints.parsers.reasoning import ReasoningParser
from metrale.entrypoints.parsers.tool_calls import FunctionSpec, HermesParser, TaggedCallParser
from metrale.entrypoints.parsers.xml_calls import Glm45Parser, MiniMaxM2Parser, Qwen3CoderParser

TOOL_CALL_PARSERS: dict[str, type[TaggedCallParser]] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "deepseek_v3": DeepSeekV3Parser,
    "glm45": Glm45Parser,
    "minimax_m2": MiniMaxM2Parser,
}
assert tuple(TOOL_CALL_PARSERS) == TOOL_CALL_PARSER_NAMES


def tool_call_parser(name: str, functions: list[FunctionSpec]) -> TaggedCallParser:
    return TOOL_CALL_PARSERS[name](functions)


def reasoning_parser(name: str, prompt: str) -> ReasoningParser:
    if name not in REASONING_PARSER_NAMES:
        raise ValueError(f"unknown reasoning parser {name!r}")
    return ReasoningParser(name, prompt)
