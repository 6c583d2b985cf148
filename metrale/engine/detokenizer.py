"""Incremental detokenization and stop strings.

Text is decoded over a short sliding window of token ids: the new text is the decode of the
window minus the decode of its older part. A window whose decode ends in U+FFFD is a UTF-8
character split across tokens: nothing is emitted until the next token completes it, so a
stream never carries a broken character.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 6  # prompt tokens kept in the window: spacing of the first output token depends on them


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def step(self, new_token_ids: list[int]) -> str:
        """The text that `new_token_ids` complete; "" while a character is still partial."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end of the output: whatever is still held (a final partial character decodes as U+FFFD)."""
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text):]


def find_stop(text: str, stop: list[str], new_chars: int) -> tuple[int, str] | None:
    """The earliest stop string that ends within the last `new_chars` characters of `text`."""
    best = None
    for s in stop:
        start = max(0, len(text) - new_chars - len(s) + 1)
        index = text.find(s, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, s)
    return best
