"""The reasoning kept apart from the answer: `<think>REASONING</think>ANSWER`, in four families.

Where the output starts decides most of it, and the prompt says where: a chat template that ends
the generation prompt inside an open `<think>` (DeepSeek-R1's, MiniMax-M2's, Qwen3's thinking-only
models', GLM-4.7's) leaves the model to write only the end; one that ends it with a closed
`<think></think>` (Qwen3 and GLM with `enable_thinking: false`) means no reasoning comes. Otherwise
the family decides:

- qwen3, glm45: reasoning only if the output opens `<think>` (after any whitespace);
- deepseek_r1, minimax_m2: the output is reasoning until `</think>`, and a leading `<think>` is
  dropped (R1's first template left it to the model).

An output that ends while still reasoning is all reasoning (it was cut off while thinking).
Whitespace next to the tags is dropped: the answer starts at its first visible character.
"""

from __future__ import annotations

from metrale.entrypoints.parsers.text_scan import SpaceHolder, partial_suffix

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Families whose output is reasoning until </think> when the prompt does not say.
_STARTS_IN_REASONING = {"qwen3": False, "glm45": False, "deepseek_r1": True, "minimax_m2": True}

_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"


def prompt_thinking(prompt: str) -> bool | None:
    """True if the prompt ends inside an open <think>, False if it ends right after a closed one,
    None if its end says nothing."""
    tail = prompt.rstrip()
    if tail.endswith(THINK_OPEN):
        return True
    if tail.endswith(THINK_CLOSE):
        return False
    return None


class ReasoningParser:
    def __init__(self, family: str, prompt: str = ""):
        if family not in _STARTS_IN_REASONING:
            raise ValueError(f"unknown reasoning parser {family!r}; known: {', '.join(_STARTS_IN_REASONING)}")
        self._fallback_reasoning = _STARTS_IN_REASONING[family]
        self._state = {True: _REASONING, False: _CONTENT, None: _OPENING}[prompt_thinking(prompt)]
        self._leading: list[str] = []  # while opening: the whitespace the output starts with
        self._visible = ""  # while opening: the first visible characters, fewer than <think>'s
        self._held = ""  # reasoning that may be the start of </think>
        self._reasoning_space = SpaceHolder()
        self._reasoning_space.strip_leading = True
        # The answer after </think> (the output's, or the prompt's) starts at its first visible character.
        self._strip_content = self._state == _CONTENT

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can go out now."""
        reasoning, content = [], []
        while text:
            if self._state == _OPENING:
                text = self._open(text)
            elif self._state == _REASONING:
                text = self._think(text, reasoning)
            else:
                if self._strip_content:
                    text = text.lstrip()
                    self._strip_content = not text
                content.append(text)
                text = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        if self._state == _OPENING:
            text = "".join(self._leading) + self._visible
            self._leading, self._visible = [], ""
            self._state = _REASONING if self._fallback_reasoning else _CONTENT
            if self._state == _CONTENT:
                return "", text
            self._held = text
        if self._state == _REASONING:
            held, self._held = self._held, ""
            return self._reasoning_space.push(held) + self._reasoning_space.flush(), ""
        return "", ""

    def parse(self, text: str) -> tuple[str, str]:
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2

    def _open(self, text: str) -> str:
        """While the output may still begin with <think>: wait, or decide; returns what is left."""
        if not self._visible:
            stripped = text.lstrip()
            if not stripped:
                self._leading.append(text)
                return ""
            self._leading.append(text[:len(text) - len(stripped)])
            text = stripped
        self._visible += text
        if self._visible.startswith(THINK_OPEN):
            rest = self._visible[len(THINK_OPEN):]
            self._leading, self._visible = [], ""
            self._state = _REASONING
            return rest
        if THINK_OPEN.startswith(self._visible):  # "<", "<th", ...: not decided yet
            return ""
        text = "".join(self._leading) + self._visible
        self._leading, self._visible = [], ""
        self._state = _REASONING if self._fallback_reasoning else _CONTENT
        return text

    def _think(self, text: str, reasoning: list[str]) -> str:
        # The held part is shorter than </think>, so each search costs the new text's length.
        text = self._held + text
        self._held = ""
        index = text.find(THINK_CLOSE)
        if index == -1:
            keep = partial_suffix(text, THINK_CLOSE)
            reasoning.append(self._reasoning_space.push(text[:len(text) - keep]))
            self._held = text[len(text) - keep:]
            return ""
        reasoning.append(self._reasoning_space.push(text[:index]))
        self._reasoning_space.drop()
        self._state = _CONTENT
        self._strip_content = True
        return text[index + len(THINK_CLOSE):]
