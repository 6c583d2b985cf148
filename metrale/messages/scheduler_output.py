"""The typed plan the scheduler hands the model runner each step, and the runner's answer.

Plain dataclasses of ints, lists and dicts: they cross process boundaries as msgpack
(`to_wire`/`from_wire`), never pickle. New requests are sent whole once; running ones as a diff.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from metrale.messages.multimodal import MediaItem
from metrale.messages.sampling_params import SamplingParams

# A token a launched step sampled whose value the host has not read yet (asynchronous scheduling).
# Placeholders only ever trail a request's tokens, on the scheduler's side and the runner's.
PLACEHOLDER = -1


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (recomputed from 0)."""

    request_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int
    state_slot: int = -1  # the slot of its per-request state; -1: the model keeps none
    media: list[MediaItem] = field(default_factory=list)  # the prompt's images and videos, in order
    # M-RoPE models with media: the prompt's positions [3][num_prompt_tokens]; a later token at
    # index i has position i + mrope_delta. None: positions are the token indices in all rows.
    mrope_positions: list[list[int]] | None = None
    mrope_delta: int = 0


@dataclass
class CachedRequestData:
    """A request the runner already holds: its new blocks and where its computation stands."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Asynchronous scheduling with drafts on the device: num_computed_tokens counts this many drafts
    # of the request's step in flight as accepted; the runner moves the request's rows back by the
    # drafts that step rejected, on the device (the host does not know yet).
    num_unverified_drafts: int = 0


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Tokens to compute this step per request, in batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests finished or preempted since the last step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    # (source, destination) KV blocks to copy before the forward pass: a request whose whole
    # prompt is cached recomputes its last token in a private copy of the last shared block.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # (checkpoint slot, request slot) state copies before the forward pass: a prefix hit of a
    # model with per-request state resumes from the state saved at the hit's end.
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    # (request slot, checkpoint slot) state copies after the forward pass: the request's chunk
    # ends on a block boundary whose state the prefix cache keeps.
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: a request's draft tokens, verified this step. Its scheduled tokens
    # are 1 + len(drafts): the last known token, then the drafts, each position sampled. A
    # PLACEHOLDER draft is one the runner's drafter proposed in the step still in flight: only the
    # device holds it (asynchronous scheduling).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, wire: dict) -> "SchedulerOutput":
        new = [NewRequestData(**{**r, "sampling_params": SamplingParams.from_dict(r["sampling_params"]),
                                 "media": [MediaItem(**m) for m in r.get("media", [])]})
               for r in wire["new_requests"]]
        cached = [CachedRequestData(**r) for r in wire["cached_requests"]]
        pairs = {name: [tuple(pair) for pair in wire[name]] for name in ("block_copies", "state_restores", "state_saves")}
        return cls(new, cached, dict(wire["num_scheduled_tokens"]), list(wire["finished_request_ids"]), **pairs,
                   draft_token_ids={rid: list(d) for rid, d in wire.get("draft_token_ids", {}).items()})


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token: its own and the top-k alternatives (ids with logprobs, best first)."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token among all tokens
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Per request that asked: the logprobs of each token the step gives it, in order (one for a
    # plain step; its accepted drafts and then its sampled token for a verify step).
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Speculative decoding: how many of a request's drafts were accepted, in order. Its new tokens
    # are those drafts, then its sampled token (the resampled one at the first rejection, or the
    # bonus token after the last draft).
    num_accepted_drafts: dict[str, int] = field(default_factory=dict)
    # ...and those accepted drafts' ids (the scheduler does not know drafts the device proposed).
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    # A runner-side drafter's (MTP, DFlash) drafts for a sampled request's next step, proposed on
    # the device from this step's hidden states; the scheduler keeps them on the request and
    # verifies them (cut to the room it has) in its next step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
