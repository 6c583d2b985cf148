"""SamplingParams: how one request picks its tokens and when it stops.

Validated when built: a bad value raises ValueError naming the field, so the server can turn it
into a 400 with `param` set and the offline API fails before any work is queued.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from metrale.messages.errors import InvalidRequestError
from metrale.messages.structured_outputs import StructuredOutputsParams

# Caps that keep one request from asking the engine for unbounded work (reliability case 7).
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
_INT64_MAX = 2**63 - 1


class SamplingParamsError(InvalidRequestError):
    """A SamplingParams field is out of range; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message, param)


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise SamplingParamsError(param, message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """The vLLM field names, so code written for vLLM reads the same."""

    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token; 0 = only the sampled one
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The grammar the output follows (a JSON schema, regex, choice, EBNF), as plain data.
    structured_outputs: StructuredOutputsParams | None = None
    # "cumulative": an output after every step, text and ids so far; "final_only": one output,
    # when the request ends (the offline API: nothing is built per step).
    output_kind: str = "cumulative"
    # Filled by the engine, not the user: the tokenizer's end-of-sequence ids.
    eos_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"n must be an integer in 1..{MAX_N}, got {self.n!r}")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 1e4, "temperature",
               f"temperature must be a number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k",
               f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or (_is_int(self.seed) and -_INT64_MAX - 1 <= self.seed <= _INT64_MAX), "seed",
               f"seed must be a 64-bit integer, got {self.seed!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and 1 <= self.max_tokens <= _INT64_MAX),
               "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for s in self.stop:
            _check(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS, "stop",
                   f"each stop string must be a non-empty string of at most {MAX_STOP_STRING_CHARS} characters")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be non-negative integers")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value!r}")
        _check(self.output_kind in ("cumulative", "final_only"), "output_kind",
               f"output_kind must be 'cumulative' or 'final_only', got {self.output_kind!r}")
        _check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            bias = self.logit_bias
            _check(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
                   f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to numbers")
            _check(all(_is_int(k) and k >= 0 and _is_number(v) and -100.0 <= v <= 100.0 for k, v in bias.items()),
                   "logit_bias", "logit_bias must map token ids (integers >= 0) to numbers in [-100, 100]")
        if self.structured_outputs is not None:
            # The grammar decides where the output ends: it allows the end-of-sequence token only
            # where the output is complete, and nothing after it.
            _check(not self.ignore_eos, "ignore_eos", "ignore_eos cannot be combined with structured outputs: "
                                                      "the grammar decides where the output ends")
            _check(not self.min_tokens, "min_tokens", "min_tokens cannot be combined with structured outputs: "
                                                      "the grammar decides where the output ends")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether the sampler must edit this request's logits before choosing."""
        return self.has_penalties or bool(self.min_tokens) or bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain JSON/msgpack-safe form, for crossing a process boundary."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> "SamplingParams":
        return cls(**fields)
