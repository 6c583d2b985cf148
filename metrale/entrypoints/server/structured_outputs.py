"""Structured outputs in the HTTP API: the request fields, and the compile before submitting.

The fields (chat and completions alike), one source per request:
  * OpenAI's `response_format`: {"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}} or {"type": "json_object"} ({"type": "text"}: none);
  * vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object", and
    "disable_any_whitespace"};
  * vLLM's older names `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

`constrain()` compiles the spec before the request reaches the engine, on the grammar cache's
worker threads (xgrammar releases the GIL, so this loop and the engine keep serving), waits at
most --structured-outputs-timeout, and answers a spec that is malformed, too large, does not
compile or not in time with a 400 naming the field it came from. The engine then finds the
grammar compiled.

For tool calls, `tool_call_structured_outputs(tools, tool_choice)` is the spec that makes
`tool_choice` "required" or a named function follow the functions' schemas (see its docstring
for the output's shape).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from metrale.messages.sampling_params import SamplingParams
from metrale.messages.structured_outputs import (MAX_SCHEMA_DEPTH, StructuredOutputsError, StructuredOutputsParams,
                                                 schema_depth)
from metrale.entrypoints.server.errors import bad_request

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs` object."""

    json_: str | dict[str, Any] | None = Field(None, alias="json", description="A JSON schema")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="An EBNF grammar (xgrammar's dialect, rule root)")
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class JSONSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputFields(_Strict):
    """The request fields; chat's and completions' request models inherit them."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = Field(None, description="vLLM extension: the grammar the "
                                                                                "output follows")
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_spec(self) -> tuple[StructuredOutputsParams, str] | None:
        """The request's spec and the field it came from (its 400s name it), or None."""
        sources: list[tuple[str, dict]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            sources.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
            sources.append(("response_format", {"json": fmt.json_schema.schema_}))
        given = self.structured_outputs
        if given is not None:
            fields = {"json": given.json_, "regex": given.regex, "choice": given.choice, "grammar": given.grammar,
                      "json_object": given.json_object or None}
            kinds = [kind for kind, value in fields.items() if value is not None]
            param = f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else "structured_outputs"
            spec = {kind: fields[kind] for kind in kinds}
            if given.disable_any_whitespace:
                spec["disable_any_whitespace"] = True
            sources.append((param, spec))
        for name, kind in GUIDED_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                sources.append((name, {kind: value}))
        if not sources:
            return None
        if len(sources) > 1:
            raise bad_request(f"give one structured-output field, not {sources[0][0]} and {sources[1][0]}",
                              sources[1][0])
        param, fields = sources[0]
        try:
            return StructuredOutputsParams(**fields), param
        except StructuredOutputsError as e:
            raise bad_request(f"{param}: {e}", param) from None


async def constrain(state, params: SamplingParams, spec: StructuredOutputsParams, param: str) -> SamplingParams:
    """`params` constrained by `spec`, once its grammar compiled; a 400 naming `param` when the
    spec cannot be combined with params, does not compile, or not within the timeout."""
    if params.structured_outputs is not None:
        raise bad_request(f"{param} cannot be combined with another structured output", param)
    constrained = params.clone(structured_outputs=spec)  # ignore_eos, min_tokens: a 400 naming them
    grammars = state.engine.engine.grammars
    if grammars is None:
        raise bad_request("structured outputs need the tokenizer, and this server runs without one "
                          "(--skip-tokenizer-init)", param)
    try:
        # The first use imports xgrammar and reads the vocabulary: not part of any compile's time.
        await asyncio.shield(asyncio.wrap_future(grammars.ready()))
        compiled = asyncio.wrap_future(grammars.submit(spec))
        compiled.add_done_callback(_retrieve)  # a compile that fails after its waiter left logs nothing
        # shield: a request that stops waiting leaves the compile (shared, cached) running.
        await asyncio.wait_for(asyncio.shield(compiled), grammars.timeout_s)
    except asyncio.TimeoutError:
        raise bad_request(f"{param}: {grammars.timeout_error(spec, grammars.timeout_s)}", param) from None
    except StructuredOutputsError as e:
        raise bad_request(f"{param}: {e}", param) from None
    return constrained


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def with_structured_outputs(state, body: StructuredOutputFields, params: SamplingParams) -> SamplingParams:
    """`params` with the request's own structured-output field, compiled (see constrain)."""
    found = body.structured_outputs_spec()
    if found is None:
        return params
    spec, param = found
    return await constrain(state, params, spec, param)


# -- tool calls ----------------------------------------------------------------------------------


def tool_call_structured_outputs(tools: list, tool_choice, parallel_tool_calls: bool = True,
                                 param: str = "tool_choice") -> StructuredOutputsParams | None:
    """The spec that constrains a chat request's output to tool calls, or None when the choice
    leaves the model free ("none", "auto", unset). `tools`: OpenAI's tool objects (dicts or the
    request's models); `tool_choice`: "required", or {"type": "function", "function": {"name"}}.

    The output the grammar allows, as JSON:
      * "required": an array of one or more calls (exactly one when parallel_tool_calls is
        false), each {"name": NAME, "parameters": ARGUMENTS}, ARGUMENTS following that
        function's `parameters` schema;
      * a named function: that function's ARGUMENTS object alone.
    """
    functions = [_function_of(tool) for tool in tools or []]
    choice = _plain(tool_choice)
    if choice in (None, "none", "auto"):
        return None
    if choice == "required":
        if not functions:
            raise bad_request("tool_choice required needs tools", param)
        defs: dict = {}
        calls = []
        for index, function in enumerate(functions):
            arguments = _hoist_defs(_arguments_schema(function), f"tool{index}_", defs)
            calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                                           "parameters": arguments},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return _spec(schema, param)
    name = ((choice or {}).get("function") or {}).get("name") if isinstance(choice, dict) else None
    if name is None:
        raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", param)
    for function in functions:
        if function["name"] == name:
            return _spec(_arguments_schema(function), param)
    raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools", param)


def _plain(value):
    return value.model_dump(by_alias=True, exclude_none=True) if isinstance(value, BaseModel) else value


def _function_of(tool) -> dict:
    tool = _plain(tool)
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request("each tool must be {\"type\": \"function\", \"function\": {\"name\", \"parameters\"}}",
                          "tools")
    return function


def _arguments_schema(function: dict) -> dict:
    schema = function.get("parameters")
    if not isinstance(schema, dict) or not schema:
        return {"type": "object", "properties": {}}
    if schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise bad_request(f"the parameters of {function['name']!r} are nested more than {MAX_SCHEMA_DEPTH} "
                          f"levels deep", "tools")
    return dict(schema)


def _hoist_defs(schema: dict, prefix: str, defs: dict) -> dict:
    """A function's schema with its "$defs"/"definitions" moved into `defs` under `prefix`, and
    its local references rewritten: nested inside the calls' array, "#/$defs/X" would resolve
    against the array's root."""
    local = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    if not local:
        return schema
    schema = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    schema = _rewrite_refs(schema, prefix)
    for name, value in local.items():
        defs[prefix + name] = _rewrite_refs(value, prefix)
    return schema


def _rewrite_refs(node, prefix: str):
    if isinstance(node, list):
        return [_rewrite_refs(item, prefix) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str):
            for root in ("#/$defs/", "#/definitions/"):
                if value.startswith(root):
                    value = "#/$defs/" + prefix + value[len(root):]
            out[key] = value
        else:
            out[key] = _rewrite_refs(value, prefix)
    return out


def _spec(schema: dict, param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except StructuredOutputsError as e:
        raise bad_request(f"{param}: {e}", param) from None
