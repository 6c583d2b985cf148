"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Strict: a number where a string belongs (or "5" where an integer belongs, or 1.0 for n) is a
type error, which the error handler turns into a 400 naming the field. Ranges are checked once,
by the engine's SamplingParams, except for the limits that are the server's own (--max-n) or
that need the model (vocabulary size). Unknown fields are ignored, as OpenAI clients send
vendor extras; known fields that met cannot honour yet are refused with a 400, never ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from metrale.messages.sampling_params import MAX_LOGPROBS, SamplingParams
from metrale.entrypoints.server.errors import bad_request
from metrale.entrypoints.server.structured_outputs import StructuredOutputFields

MAX_STOP_TOKEN_IDS = 256
_LOGIT_BIAS_KEY = re.compile(r"^[0-9]{1,10}$")


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text is not valid Unicode (it holds a lone surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Text
    text: Text | None = None


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class MessageToolCall(_Strict):
    """A call an assistant message made earlier in the conversation."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: Text | None = None  # tool
    reasoning_content: Text | None = None  # assistant: templates that keep the last turn's reasoning read it


# OpenAI's rule for function names, with '.' and ':' too (namespaced tools); the parsers rely on a
# name holding no whitespace, quotes or angle brackets.
ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionDefinition(_Strict):
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# Keys of apply_chat_template that a request's chat_template_kwargs may not set: the server sets
# them itself (a template of the request's own would be code the server runs).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise bad_request(f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")
    return dict(kwargs or {})


class SamplingFields(_Strict, StructuredOutputFields):
    """The fields chat and completions share (structured outputs: structured_outputs.py)."""

    model: Text | None = Field(None, description="The served model name (see GET /v1/models)")
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[Text, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    return_token_ids: bool | None = Field(False, description="vLLM extension: each choice also carries the "
                                                               "generated token ids (`token_ids`)")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None, max_n: int,
                        vocab_size: int, defaults: dict | None = None) -> SamplingParams:
        """The engine's SamplingParams; raises a 400 (APIError or SamplingParamsError) on bad values.
        `defaults` (the model's generation config) fill the fields the request leaves unset."""
        n = 1 if self.n is None else self.n
        if not 1 <= n <= max_n:
            raise bad_request(f"n must be in 1..{max_n} on this server, got {n}", "n")
        logit_bias = check_logit_bias(self.logit_bias, vocab_size)
        stop_token_ids = self.stop_token_ids or []
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t < vocab_size for t in stop_token_ids):
            raise bad_request(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} ids in 0..{vocab_size - 1}",
                              "stop_token_ids")
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        defaults = dict(defaults or {})
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        defaults.pop("max_tokens", None)
        fields = {**defaults, **{k: v for k, v in given.items() if v is not None}}
        return SamplingParams(n=n, max_tokens=max_tokens, logprobs=logprobs, stop=self.stop,
                              stop_token_ids=stop_token_ids, logit_bias=logit_bias, **fields)


def check_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """Reliability case 8: every malformed logit_bias is a 400 naming it. OpenAI's keys are token
    ids as strings; the engine's are ints."""
    if not logit_bias:
        return None
    for key, value in logit_bias.items():
        if not _LOGIT_BIAS_KEY.match(key) or int(key) >= vocab_size:
            raise bad_request(f"logit_bias keys must be token ids in 0..{vocab_size - 1}, got {key!r}", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value!r}", "logit_bias")
    return {int(key): float(value) for key, value in logit_bias.items()}


def check_max_tokens(value: int | None, param: str) -> None:
    if value is not None and value < 1:
        raise bad_request(f"{param} must be at least 1, got {value}", param)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension: extra variables for "
                                                                          "the chat template, such as "
                                                                          "enable_thinking")
    include_reasoning: bool | None = Field(True, description="vLLM extension: false drops the reasoning "
                                                             "(with --reasoning-parser)")

    def engine_logprobs(self) -> int | None:
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in 0..{MAX_LOGPROBS}, got {top}", "top_logprobs")
        if not self.logprobs:
            if top:
                raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
            return None
        return top or 0

    def resolved_max_tokens(self) -> int | None:
        check_max_tokens(self.max_tokens, "max_tokens")
        check_max_tokens(self.max_completion_tokens, "max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: Text | None = None

    def engine_logprobs(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}", "logprobs")
        return self.logprobs

    def check_supported(self) -> None:
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of other than n is not supported yet", "best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs needs prompt logprobs, which met does not compute yet", "echo")
        check_max_tokens(self.max_tokens, "max_tokens")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        for entry in prompt:
            if not entry:
                raise bad_request("prompt must not hold an empty prompt", "prompt")
        return list(prompt)


class TokenizeRequest(_Strict):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: list[int]


class ProfileRequest(_Strict):
    num_steps: int | None = Field(None, ge=1, description="Stop by itself after this many engine steps")
