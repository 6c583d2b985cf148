"""What the engine returns: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob, the sampled token first, then the top-k.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    metrics: dict = field(default_factory=dict)
