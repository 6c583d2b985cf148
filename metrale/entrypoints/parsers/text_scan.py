"""Small linear-time helpers the streaming parsers share."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with: text a stream must
    hold back, since the next chunk may complete the marker."""
    start = max(0, len(text) - len(marker) + 1)
    first = marker[0]
    index = text.find(first, start)
    while index != -1:
        if marker.startswith(text[index:]):
            return len(text) - index
        index = text.find(first, index + 1)
    return 0


class MarkerSearch:
    """Finds a marker in text that arrives in chunks, looking at each character a bounded number
    of times: only the last len(marker) - 1 characters are searched again with the next chunk."""

    def __init__(self, marker: str):
        self.marker = marker
        self._tail = ""

    def reset(self) -> None:
        self._tail = ""

    def find(self, chunk: str) -> int:
        """Where in `chunk` the marker ends (one past its last character), or -1. Without a
        match the chunk is remembered; with one, the search starts afresh."""
        probe = self._tail + chunk
        index = probe.find(self.marker)
        if index == -1:
            keep = len(self.marker) - 1
            self._tail = probe[-keep:] if keep else ""
            return -1
        self._tail = ""
        return index + len(self.marker) - (len(probe) - len(chunk))


class SpaceHolder:
    """Holds back the whitespace at the end of emitted text, for a parser that drops whitespace
    next to a marker (`drop`) but keeps it elsewhere (`flush`). With `strip_leading` set, the
    whitespace at the start of what follows is dropped too. Linear: held whitespace is joined once."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self.strip_leading = False

    def push(self, text: str) -> str:
        """The text that can go out now."""
        if self.strip_leading:
            text = text.lstrip()
            if not text:
                return ""
            self.strip_leading = False
        body = text.rstrip()
        if not body:
            if text:
                self._parts.append(text)
            return ""
        out = "".join(self._parts) + body if self._parts else body
        self._parts = [text[len(body):]] if len(body) < len(text) else []
        return out

    def drop(self) -> None:
        self._parts = []

    def flush(self) -> str:
        out = "".join(self._parts)
        self._parts = []
        return out
