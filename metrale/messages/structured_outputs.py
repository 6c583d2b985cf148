"""StructuredOutputsParams: the grammar a request's output must follow, with vLLM's names.

Plain data: the spec as the caller gave it (a JSON schema, a regex, choices, an EBNF grammar),
never a compiled object, so it travels inside SamplingParams across process boundaries as
msgpack. The grammar engine (metrale/structured) compiles it, keyed by `cache_key()`.

Checked when built: exactly one kind, the right types, at most MAX_SPEC_BYTES of spec text and
a JSON schema nested at most MAX_SCHEMA_DEPTH deep (a deep schema is what makes a compile slow
or a recursive converter overflow). What only the compiler can judge (an unsupported schema
keyword, a regex that does not parse) is a GrammarError at compile time, also a 400.
"""

from __future__ import annotations

import dataclasses
import json as json_module
from dataclasses import dataclass

from metrale.messages.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "EBNF grammar",
              "json_object": "JSON object grammar"}
MAX_SPEC_BYTES = 256 * 1024
MAX_SCHEMA_DEPTH = 64
PARAM = "structured_outputs"  # what errors name offline; the server names its own field


class StructuredOutputsError(InvalidRequestError):
    def __init__(self, message: str, param: str = PARAM):
        super().__init__(message, param)


def schema_depth(value) -> int:
    """Nesting depth of a JSON value (containers only), without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth = max(depth, level)
        if depth > MAX_SCHEMA_DEPTH:
            return depth
        stack.extend((child, level + 1) for child in children)
    return depth


def canonical_json(value) -> str:
    return json_module.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass
class StructuredOutputsParams:
    """Give exactly one of json (a JSON schema, as a dict or its JSON text), regex, choice (the
    output is one of these strings), grammar (EBNF, xgrammar's dialect, rule `root`) and
    json_object (any JSON object). JSON outputs allow a bounded amount of whitespace between
    tokens; `disable_any_whitespace` allows none beyond the `", "` and `": "` separators."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                f"give exactly one of {', '.join(KINDS)} (got {', '.join(given) if given else 'none'})")
        if not isinstance(self.disable_any_whitespace, bool):
            raise StructuredOutputsError("disable_any_whitespace must be a boolean")
        getattr(self, f"_check_{given[0]}")()
        try:
            size = len(self.spec_text().encode("utf-8"))
        except UnicodeEncodeError:
            raise StructuredOutputsError(f"the {KIND_NAMES[given[0]]} is not valid Unicode (it holds a lone "
                                         f"surrogate)") \
                from None
        if size > MAX_SPEC_BYTES:
            raise StructuredOutputsError(f"the {KIND_NAMES[given[0]]} is {size} bytes; at most {MAX_SPEC_BYTES} "
                                         f"are accepted")

    # -- checks per kind ----------------------------------------------------------------------

    def _check_json(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            if len(schema) > MAX_SPEC_BYTES:
                raise StructuredOutputsError(f"the JSON schema is over {MAX_SPEC_BYTES} bytes")
            try:
                schema = json_module.loads(schema)
            except (ValueError, RecursionError) as e:
                raise StructuredOutputsError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise StructuredOutputsError("the JSON schema must be a JSON object")
        if schema_depth(schema) > MAX_SCHEMA_DEPTH:
            raise StructuredOutputsError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")

    def _check_regex(self) -> None:
        if not isinstance(self.regex, str) or not self.regex:
            raise StructuredOutputsError("regex must be a non-empty string")

    def _check_choice(self) -> None:
        choice = self.choice
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
            raise StructuredOutputsError("choice must be a non-empty list of strings")

    def _check_grammar(self) -> None:
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise StructuredOutputsError("grammar must be a non-empty string (EBNF)")

    def _check_json_object(self) -> None:
        if self.json_object is not True:
            raise StructuredOutputsError("json_object must be true")

    # -- what the grammar engine reads ---------------------------------------------------------

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def schema(self) -> dict | None:
        """The JSON schema as a dict (json), {"type": "object"} (json_object), else None."""
        if self.json_object:
            return {"type": "object"}
        if self.json is None:
            return None
        return json_module.loads(self.json) if isinstance(self.json, str) else self.json

    def spec_text(self) -> str:
        """The spec as one canonical string: equal specs give equal text."""
        kind = self.kind
        if kind in ("json", "json_object"):
            return canonical_json(self.schema())
        if kind == "choice":
            return canonical_json(self.choice)
        return getattr(self, kind)

    def cache_key(self) -> tuple[str, str, bool]:
        whitespace = self.disable_any_whitespace and self.kind in ("json", "json_object")
        return self.kind, self.spec_text(), whitespace

    # -- the wire ------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, value: "StructuredOutputsParams | dict | None") -> "StructuredOutputsParams | None":
        """From itself, its wire form (a dict), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise StructuredOutputsError(f"unknown field(s): {', '.join(sorted(unknown))}")
            return cls(**value)
        raise StructuredOutputsError(f"structured_outputs must be a StructuredOutputsParams, not "
                                     f"{type(value).__name__}")
