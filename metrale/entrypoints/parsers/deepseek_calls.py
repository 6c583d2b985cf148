"""DeepSeek-V3's tool calls, between special tokens:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

DeepSeek-V3.1 and later write `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`
(no type, no code fence); both are read. One block holds every call of the turn.
"""

from __future__ import annotations

from metrale.entrypoints.parsers.tool_calls import TaggedCallParser, ToolCall, json_arguments, load_json

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


class DeepSeekV3Parser(TaggedCallParser):
    open_marker = CALLS_BEGIN
    close_marker = CALLS_END

    def parse_block(self, body: str) -> list[ToolCall] | None:
        calls, pos = [], 0
        while True:
            start = body.find(CALL_BEGIN, pos)
            if start == -1:
                break
            if body[pos:start].strip():
                return None
            end = body.find(CALL_END, start)
            if end == -1:
                return None
            call = self._call(body[start + len(CALL_BEGIN):end])
            if call is None:
                return None
            calls.append(call)
            pos = end + len(CALL_END)
        if body[pos:].strip():
            return None
        return calls or None

    def _call(self, item: str) -> ToolCall | None:
        sep = item.find(SEP)
        if sep == -1:
            return None
        head, rest = item[:sep].strip(), item[sep + len(SEP):]
        if rest.lstrip().startswith("{"):  # V3.1: NAME<sep>ARGUMENTS
            name, arguments = head, rest
        else:  # V3: TYPE<sep>NAME\n```json\nARGUMENTS\n```
            newline = rest.find("\n")
            if head != "function" or newline == -1:
                return None
            name, fenced = rest[:newline].strip(), rest[newline + 1:].strip()
            if not fenced.startswith("```") or not fenced.endswith("```") or len(fenced) < 6:
                return None
            fenced = fenced[3:len(fenced) - 3]
            arguments = fenced[4:] if fenced.startswith("json") else fenced
        if not self.known(name):
            return None
        try:
            text = json_arguments(load_json(arguments))
        except ValueError:
            return None
        return None if text is None else ToolCall(name, text)
