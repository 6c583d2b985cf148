"""From sampled token ids to RequestOutputs: detokenization, stop strings, logprobs, n > 1.

A request with n > 1 runs as n child requests in the scheduler; their outputs are gathered here
under the parent's id. Text that could still be the start of a stop string is held back from
`text` until it is known not to be one, so a streamed reply never shows part of a stop string.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from metrale.engine.detokenizer import IncrementalDetokenizer, find_stop
from metrale.messages.outputs import CompletionOutput, Logprob, RequestOutput
from metrale.engine.request import Request
from metrale.messages.scheduler_output import TokenLogprobs


@dataclass
class SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    stop: list[str]
    include_stop: bool
    want_logprobs: bool
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def held_back(self) -> int:
        if self.finish_reason is not None or not self.stop:
            return 0
        return max(len(s) for s in self.stop) - 1

    def completion(self) -> CompletionOutput:
        visible = self.text[:len(self.text) - self.held_back] if self.held_back else self.text
        return CompletionOutput(self.index, visible, list(self.token_ids),
                                self.cumulative_logprob if self.want_logprobs else None,
                                list(self.logprobs) if self.want_logprobs else None,
                                self.finish_reason, self.stop_reason)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState]
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    error: str | None = None
    final_only: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def output(self) -> RequestOutput:
        metrics = {"arrival_time": self.arrival_time, "first_token_time": self.first_token_time,
                   "last_token_time": self.last_token_time}
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [s.completion() for s in self.sequences], self.finished, self.error, metrics)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, SequenceState]] = {}

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        sequences = []
        for index, child in enumerate(children):
            p = child.sampling_params
            detok = (IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, p.skip_special_tokens)
                     if self.tokenizer is not None else None)
            sequences.append(SequenceState(index, detok, list(p.stop), p.include_stop_str_in_output,
                                           p.logprobs is not None))
        parent = ParentState(request_id, prompt, children[0].prompt_token_ids, sequences, time.monotonic(),
                             final_only=children[0].sampling_params.output_kind == "final_only")
        self.parents[request_id] = parent
        for child, seq in zip(children, sequences):
            self.child_to_parent[child.request_id] = (parent, seq)

    def _decoded(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def process_tokens(self, request: Request, new_token_ids: list[int],
                       logprobs: TokenLogprobs | None) -> str | None:
        """Record a child's new tokens. Returns the stop string it produced, if any."""
        parent, seq = self.child_to_parent[request.request_id]
        now = time.monotonic()
        parent.first_token_time = parent.first_token_time or now
        parent.last_token_time = now
        seq.token_ids.extend(new_token_ids)
        if logprobs is not None:
            entry = {logprobs.token_id: Logprob(logprobs.logprob, logprobs.rank, self._decoded(logprobs.token_id))}
            for rank, (tid, lp) in enumerate(zip(logprobs.top_ids, logprobs.top_logprobs), start=1):
                entry.setdefault(tid, Logprob(lp, rank, self._decoded(tid)))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += logprobs.logprob
        if seq.detokenizer is None:
            return None
        new_text = seq.detokenizer.step(new_token_ids)
        seq.text += new_text
        if seq.stop and new_text:
            hit = find_stop(seq.text, seq.stop, len(new_text))
            if hit is not None:
                index, stop = hit
                seq.text = seq.text[:index + (len(stop) if seq.include_stop else 0)]
                return stop
        return None

    def finish(self, request: Request, finish_reason: str, stop_reason=None) -> None:
        pair = self.child_to_parent.pop(request.request_id, None)
        if pair is None:
            return
        parent, seq = pair
        if seq.detokenizer is not None and not isinstance(stop_reason, str):
            seq.text += seq.detokenizer.flush()
        seq.finish_reason = finish_reason
        seq.stop_reason = stop_reason
        if request.error:
            parent.error = request.error

    def output_of(self, parent_id: str) -> RequestOutput | None:
        """The parent's output now, or None while a final-only request runs."""
        parent = self.parents[parent_id]
        if parent.final_only and not parent.finished:
            return None
        out = parent.output()
        if parent.finished:
            del self.parents[parent_id]
        return out

    def parent_of(self, child_id: str) -> str | None:
        pair = self.child_to_parent.get(child_id)
        return pair[0].request_id if pair else None
