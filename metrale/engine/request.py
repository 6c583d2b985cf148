"""A request as the scheduler sees it: plain ints and lists, no tensors."""

from __future__ import annotations

import enum
import time
from collections import deque

from metrale.messages.sampling_params import SamplingParams
from metrale.messages.scheduler_output import PLACEHOLDER


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, to be recomputed
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens, the context length or the KV pool's size
    FINISHED_ABORTED = "abort"  # the client went away or the engine cancelled it
    FINISHED_ERROR = "error"  # the request can never be served (message in `error`)

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


class Request:
    """Invariant: 0 <= num_computed_tokens - num_unverified_drafts <= num_tokens; tokens past
    num_computed_tokens have no KV yet."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 seed: int, arrival_time: float | None = None, extra_keys: tuple = (), multimodal=None):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)  # prompt, then outputs as they are sampled
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        # Mixed into the prefix-cache hashes: requests with different keys never share KV.
        self.extra_keys = extra_keys
        # The prompt's media (multimodal/inputs.py MultiModalInputs, or None): its items' spans in
        # token_ids, their content hashes (also in the prefix-cache keys of the blocks they
        # touch) and M-RoPE positions. The scheduler reads ints and strings of it only.
        self.multimodal = multimodal
        self.media = list(multimodal.items) if multimodal is not None else []
        self.media_keys = tuple((m.offset, m.end, m.content_hash) for m in self.media)
        # Every request samples from its own counter-based stream (seed, output index), so its
        # tokens do not depend on the batch it runs in nor on being preempted and recomputed.
        self.seed = seed
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.num_computed_tokens = 0
        self.num_pending = 0  # trailing placeholders
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        # Speculative decoding: per step in flight that samples for the request, oldest first (one
        # per trailing placeholder), the drafts it verifies ([] for a plain step; PLACEHOLDERs for
        # drafts that only the device holds, under asynchronous scheduling). Until a step's result
        # arrives, num_computed_tokens counts its drafts as if all were accepted; the result rolls
        # it back by the number rejected.
        self.inflight_drafts: deque[list[int]] = deque()
        # A runner-side drafter's (MTP, DFlash) drafts from the request's last sampled step: its
        # next step's drafts (engine/runner_drafts.py).
        self.runner_drafts: list[int] = []
        # How many drafts the runner's drafter proposes on the device for the request's next step,
        # from the last step planned to sample for it (scheduler._lookahead_blocks).
        self.device_drafts_ready = 0
        # The runner's drafter proposed nothing for it at the last step read (prompt lookup found
        # no match): no drafts the device holds are planned for it until it proposes again.
        self.proposal_missed = False

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def add_placeholder(self, drafts: list[int]) -> None:
        """A launched step samples for the request after verifying `drafts` ([] for none)."""
        self.token_ids.append(PLACEHOLDER)
        self.num_pending += 1
        self.inflight_drafts.append(drafts)

    def resolve_placeholder(self, accepted: list[int], token_id: int) -> list[int]:
        """The oldest step in flight's result: its accepted drafts, then the token sampled after
        them, in place of its placeholder. Returns the drafts that step verified."""
        index = len(self.token_ids) - self.num_pending
        self.token_ids[index:index + 1] = accepted + [token_id]
        self.num_pending -= 1
        return self.inflight_drafts.popleft()

    @property
    def drafts_in_flight(self) -> bool:
        """A step in flight verifies drafts: how many tokens it gives is not known yet."""
        return any(self.inflight_drafts)

    @property
    def num_unverified_drafts(self) -> int:
        """Drafts num_computed_tokens counts whose verification is still in flight."""
        return sum(len(d) for d in self.inflight_drafts) if self.inflight_drafts else 0

    def drop_placeholders(self) -> None:
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0
        self.inflight_drafts.clear()

    @property
    def num_tokens_if_accepted(self) -> int:
        """The sequence's length once the steps in flight are read, if they accept every draft:
        what num_computed_tokens counts, and the most KV the request can need so far."""
        return len(self.token_ids) + self.num_unverified_drafts

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
