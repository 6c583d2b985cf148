"""Each --reasoning-parser against transcripts in its family's real format, with the end of the
prompt its chat template writes, fed whole and in random chunk splits."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from parser_streams import check_streams
from metrale.entrypoints.parsers import REASONING_PARSER_NAMES
from metrale.entrypoints.parsers.reasoning import ReasoningParser, prompt_thinking


@dataclass(frozen=True)
class Thought:
    text: str


class _Events:
    """A reasoning parser's (reasoning, content) pairs as the events the stream helpers compare."""

    def __init__(self, family: str, prompt: str):
        self.parser = ReasoningParser(family, prompt)

    @staticmethod
    def _events(pair: tuple[str, str]) -> list:
        reasoning, content = pair
        return ([Thought(reasoning)] if reasoning else []) + ([content] if content else [])

    def feed(self, text: str) -> list:
        return self._events(self.parser.feed(text))

    def finish(self) -> list:
        return self._events(self.parser.finish())

    def parse(self, text: str) -> list:
        return self.feed(text) + self.finish()


def split(family: str, prompt: str, text: str) -> tuple[str, str]:
    """(reasoning, content), checked to be the same however the text is streamed."""
    reasoning, content = [], []
    for event in check_streams(lambda: _Events(family, prompt), text):
        (reasoning.append(event.text) if isinstance(event, Thought) else content.append(event))
    return "".join(reasoning), "".join(content)


QWEN3 = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINKING = QWEN3 + "<think>\n\n</think>\n\n"  # the template with enable_thinking false
QWEN3_THINKING_ONLY = QWEN3 + "<think>\n"  # Qwen3-*-Thinking-2507
R1 = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n"
R1_FIRST_TEMPLATE = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>"
GLM45 = "[gMASK]<sop><|user|>\nWhat is 2+2?<|assistant|>"
GLM45_NO_THINKING = GLM45 + "\n<think></think>"
GLM47 = GLM45 + "<think>"
MINIMAX = "]~!b[]~b]system\nYou are a helpful assistant.[e~[\n]~b]user\nWhat is 2+2?[e~[\n]~b]ai\n<think>\n"


def test_every_vllm_name_has_a_parser():
    for name in REASONING_PARSER_NAMES:
        ReasoningParser(name)
    with pytest.raises(ValueError):
        ReasoningParser("granite")


@pytest.mark.parametrize("family,prompt,text,expected", [
    ("qwen3", QWEN3, "<think>\nThe user asks 2+2.\nThat is 4.\n</think>\n\n2 + 2 = 4.",
     ("The user asks 2+2.\nThat is 4.", "2 + 2 = 4.")),
    ("qwen3", QWEN3_NO_THINKING, "2 + 2 = 4. Tags such as <think> stay text.",
     ("", "2 + 2 = 4. Tags such as <think> stay text.")),
    ("qwen3", QWEN3_THINKING_ONLY, "Simple.\n</think>\n\n4", ("Simple.", "4")),
    ("qwen3", QWEN3, "  A model that does not think: 4.", ("", "  A model that does not think: 4.")),
    ("qwen3", QWEN3, "<think>\nStill thinking when max_tokens ran o", ("Still thinking when max_tokens ran o", "")),
    ("qwen3", QWEN3, "<thinking>is not the tag</thinking>", ("", "<thinking>is not the tag</thinking>")),
    ("deepseek_r1", R1, "Okay, 2+2 is 4.\n</think>\n\nThe answer is **4**.",
     ("Okay, 2+2 is 4.", "The answer is **4**.")),
    ("deepseek_r1", R1_FIRST_TEMPLATE, "<think>\nOkay.\n</think>\n\n4", ("Okay.", "4")),
    ("deepseek_r1", R1_FIRST_TEMPLATE, "Okay, no opening tag.</think>4", ("Okay, no opening tag.", "4")),
    ("deepseek_r1", R1, "Cut off before the end", ("Cut off before the end", "")),
    ("glm45", GLM45, "\n<think>The user wants 2+2.</think>\n2+2 equals 4.", ("The user wants 2+2.", "2+2 equals 4.")),
    ("glm45", GLM45_NO_THINKING, "\n2+2 equals 4.", ("", "2+2 equals 4.")),
    ("glm45", GLM47, "Simple sum.</think>4", ("Simple sum.", "4")),
    ("glm45", GLM45, "4, without thinking", ("", "4, without thinking")),
    ("minimax_m2", MINIMAX, "The user asks for 2+2, which is 4.\n</think>\n\n2 + 2 = 4",
     ("The user asks for 2+2, which is 4.", "2 + 2 = 4")),
    ("minimax_m2", MINIMAX, "Unicode survives: 東京 🙂 </thin almost</think>ok", ("Unicode survives: 東京 🙂 </thin almost", "ok")),
])
def test_reasoning_split(family, prompt, text, expected):
    assert split(family, prompt, text) == expected


def test_prompt_says_where_the_output_starts():
    assert prompt_thinking(R1) is True and prompt_thinking(MINIMAX) is True and prompt_thinking(GLM47) is True
    assert prompt_thinking(QWEN3_NO_THINKING) is False and prompt_thinking(GLM45_NO_THINKING) is False
    assert prompt_thinking(QWEN3) is None and prompt_thinking(R1_FIRST_TEMPLATE) is None


@pytest.mark.parametrize("family", REASONING_PARSER_NAMES)
@pytest.mark.parametrize("prompt", [QWEN3, QWEN3_NO_THINKING, R1])
def test_random_mixes_of_tags(family, prompt):
    import random

    rng = random.Random(family + prompt)
    pieces = ["<think>", "</think>", "<", "</", "<thi", "</thin", "\n", " ", "a", "東", "🙂"]
    for _ in range(40):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        reasoning, content = split(family, prompt, text)
        # nothing is invented, and what is dropped is only the tags and the whitespace beside them
        assert len(reasoning) + len(content) <= len(text)
        assert content in text and reasoning.replace("<think>", "") in text.replace("<think>", "")
