"""Parsers of a model's raw output text into what OpenAI's chat API returns: the reasoning kept
apart from the answer (`reasoning.py`) and tool calls (`tool_calls.py` and one file per family of
formats). They are plain Python over text, torch-free, and stream: a parser is fed the text as it
is generated and answers with what it has decided, and fed the whole text at once it decides the
same (the non-streamed reply is the streamed one, concatenated).

Every parser is linear in its input: markers are found with str.find from where the last search
stopped, never with a backtracking regular expression, and no text is rescanned per chunk."""

from __future__ import annotations

REASONING_PARSER_NAMES = ("qwen3", "deepseek_r1", "glm45", "minimax_m2")
TOOL_CALL_PARSER_NAMES = ("hermes", "qwen3_coder", "deepseek_v3", "glm45", "minimax_m2")
