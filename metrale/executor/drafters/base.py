"""The runner-side drafter interface of speculative decoding (MTP, DFlash).

A runner-side drafter proposes the next step's draft tokens from the target's hidden states of
this step, on the device, right after the rejection sampler (the n-gram drafter, which needs only
token ids, runs on the scheduler's side instead: engine/ngram_drafter.py). The contract:

- **Built at startup** from the SpeculativeConfig and the loaded target model
  (`executor/drafters/__init__.py: build_drafter`), before the runner: the runner takes it as
  `ModelRunner(..., drafter=...)`.
- **Its caches are cache specs like any other layer's.** `cached_layers()` lists its stateful
  modules (each a `CachedLayer` with a model layer number no trunk layer uses); the runner adds
  them to its own, so `CacheLayout`, the memory plan, the allocation and `GET /memory` count and
  bind them. Paged caches share the request's block table: the drafter's entry for position p
  sits in the same block and slot as the trunk's.
- **Called every step that computes tokens** (prefill chunks too: a drafter with a KV cache fills
  it over every position), with a `DraftInputs`: the step's layout, input ids, the trunk's final
  hidden states (and those of `hidden_layers`, the layers it asked for), the token after each
  row's position (`next_token_ids`), and for each sampled request its last accepted row, the
  number of drafts accepted and the sampled token, all on the device (no host sync needed).
- **Returns a `DraftOutput`**: up to `k` draft token ids per sampled request (-1 pads a shorter
  draft), optionally the draft distributions q (for the rejection sampler's min(1, p/q) rule; None:
  each draft is a point mass, as n-gram's). The runner reads them with the step's result and
  sends them back in `ModelRunnerOutput.draft_token_ids`; the scheduler keeps them on the request
  and uses them (cut to the room it has) as that request's next drafts.
- `sha256` identifies its weights (logged at startup; the cost model's calibration table is keyed
  on it); `k` is the most drafts it proposes per request; `lookahead_tokens` is how many KV slots
  past a step's last computed position it writes (a chained drafter writes k - 1): the scheduler
  reserves blocks for them, and the drafter cuts a draft where a request's blocks end.

Rows a drafter computes past a request's last accepted position (rejected drafts) are stale; the
scheduler rolls the request back over them, so the next step recomputes, and overwrites, every
cache entry at those positions before anything reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from metrale.layers.cache_spec import CachedLayer
from metrale.layers.forward_context import BatchLayout, ForwardContext


@dataclass
class DraftInputs:
    """One step, as a runner-side drafter sees it. Tensors are on the device; `*_cpu` on the host."""

    layout: BatchLayout  # the step's layout (the trunk's forward pass ran over it)
    input_ids: torch.Tensor  # int64 [num_tokens]
    hidden: torch.Tensor  # [num_tokens, hidden]: the trunk's final hidden states (after its last norm)
    layer_hidden: dict[int, torch.Tensor]  # trunk layer i's output (residual stream), for i in hidden_layers
    # The token at each row's position + 1: the next input within a chunk, the prompt's next token
    # after a chunk that does not reach the sequence's end, the sampled token at a sampled request's
    # last accepted row; rows after that (rejected drafts) hold the rejected drafts.
    next_token_ids: torch.Tensor  # int64 [num_tokens]
    # Per sampled request, in `request_ids` order:
    request_ids: list[str]
    seq_index_cpu: list[int]  # its sequence (index into the layout's sequences)
    last_rows: torch.Tensor  # int64 [num_sampled]: the row of its last accepted position
    num_accepted: torch.Tensor  # int64 [num_sampled]: drafts accepted this step (0: none verified)
    sampled_tokens: torch.Tensor  # int64 [num_sampled]: the token it got after them
    capacity_cpu: list[int]  # per sequence: the tokens its block table holds (KV room)
    forward_context: Callable[[BatchLayout], ForwardContext]  # the runner's, for the drafter's own passes
    sampled_vocab_size: int | None = None  # ids at or past it are never proposed (a padded vocabulary)
    # seq_index_cpu and, per sampled request, its sequence's KV room, on the device (int64): no
    # host list indexes a device tensor in a step (a blocking copy; executor/step_indices.py).
    seq_index: torch.Tensor | None = None
    capacity: torch.Tensor | None = None
    seq_request_ids: list[str] | None = None  # every sequence's request, in the layout's order


@dataclass
class DraftOutput:
    token_ids: torch.Tensor  # int64 [num_sampled, k]; -1 where a request's draft is shorter
    # [num_sampled, k, vocab] float32 probabilities the drafts were drawn from; None: point masses
    probs: torch.Tensor | None = None


class RunnerDrafter:
    """Base of the drafters that run in the model runner. Subclasses set the attributes and
    implement `cached_layers` and `propose`."""

    method: str  # speculative_config's method, as named in the logs
    k: int  # the most drafts per request and step
    sha256: str | None  # of its weights
    hidden_layers: tuple[int, ...] = ()  # trunk layers whose outputs it reads (DraftInputs.layer_hidden)
    lookahead_tokens: int = 0  # KV slots past a step's last computed position it writes
    reads_hidden_states = True  # False: token ids and positions alone (a prefill graph's step will do)

    def cached_layers(self) -> list[CachedLayer]:
        """Its stateful modules, in order; the runner allocates and binds their caches."""
        raise NotImplementedError

    def allocate(self, max_num_seqs: int, device: torch.device) -> None:
        """Buffers of its own beside the caches, once their sizes are known (the runner's allocate_caches)."""

    def admit(self, request_id: str, token_ids: list[int]) -> None:
        """A request the runner has not seen, or one resumed after preemption, with its tokens so far."""

    def forget(self, request_id: str) -> None:
        """A request finished, aborted or preempted."""

    def propose(self, inputs: DraftInputs) -> DraftOutput:
        """The next step's drafts of every sampled request, after filling its own caches over the
        step's rows. Runs under torch.inference_mode and the runner's kernel path."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.method}, k = {self.k}, sha256 {self.sha256 or 'unknown'}"
