"""The one piece of per-step state layers may read: published by the model runner for the
duration of a forward pass, through a context manager that cannot nest.

The runner builds one BatchLayout per step, the same for every kind of cache; each kind's
backend turns it into its own metadata (AttentionMetadata for attention, GDN metadata for
linear attention), and a layer reads its kind's backend and metadata from the context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from metrale.layers.cache_backend import CacheBackend


class DeviceLengths(Sequence):
    """Sequence lengths only the device knows: a step planned over a verify step still in flight
    (asynchronous scheduling) has its lengths moved back on the device by the drafts that step
    rejected (executor/last_step.py). A host reader gets them the first time it asks, at the price
    of one wait for the device; their count is known without it. Readers that need no more than
    upper bounds take BatchLayout.seq_len_bounds_cpu instead."""

    def __init__(self, lengths: torch.Tensor):
        self._device, self._host = lengths, None

    def _values(self) -> list[int]:
        if self._host is None:
            self._host = self._device.tolist()
        return self._host

    def __len__(self) -> int:
        return self._device.shape[0]

    def __getitem__(self, index):
        return self._values()[index]

    def __iter__(self):
        return iter(self._values())


@dataclass
class DraftStates:
    """Where a verify step (speculative decoding) keeps the per-request state of a model with
    linear-attention layers after each drafted position, so that the state of the last accepted
    position can be selected once the rejection sampler has run (on the device, no host sync).

    Sequence i of a verify step computes 1 + num_drafts[i] positions (its last token, then its
    drafts). Every state backend writes its state after position j < num_drafts[i] into row
    state_rows[i, j] of its state tensors, and the state after the last position into the
    sequence's own slot, as in any step. Rows j >= num_drafts[i] name the padding slot (never
    read). The shapes depend on the batch size and the configured k alone (`max_drafts`), not on
    the drafts of the step."""

    num_drafts: torch.Tensor  # int32 [num_seqs]; 0: not drafted this step
    state_rows: torch.Tensor  # int32 [num_seqs, max_drafts]: the scratch rows of each sequence
    drafted: torch.Tensor  # int64 [num_drafted]: batch indices of drafted sequences, in the rejection sampler's order
    max_drafts: int  # k, fixed at startup
    # Every sequence continues from its state and computes exactly 1 + num_drafts[i] tokens (the
    # step holds decodes and verifies only, no prefill chunk).
    all_continue: bool


@dataclass
class BatchLayout:
    """One step's flattened batch. Sequence i owns query rows query_start_loc[i]..[i+1]; those
    are the LAST query_len_i positions of a context of seq_lens[i] tokens (cached prefix + new
    tokens), and its per-request state (if the model keeps any) is in slot state_slots[i]."""

    positions: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1: padding, not written
    state_slots: torch.Tensor  # int32 [num_seqs]
    has_initial_state: torch.Tensor  # int32 [num_seqs]; 0: the sequence starts at position 0 this step
    max_query_len: int
    max_seq_len: int  # an upper bound
    query_lens_cpu: list[int]
    seq_lens_cpu: Sequence[int]  # a list, or DeviceLengths where only the device knows them
    # One new token for every sequence, each continuing a computed context (a first token of a
    # one-token prompt is not a decode: it has no state to continue).
    is_pure_decode: bool
    # A verify step of a model with per-request state: where the states after each drafted
    # position go (None in every other step).
    drafts: DraftStates | None = None
    # A verify step laid out for a CUDA graph (executor/cuda_graphs.py): every sequence owns
    # exactly `uniform_query_len` rows (i*q .. i*q+q-1), the first real_query_lens[i] real and
    # the rest dummy rows (slot -1, results ignored); seq_lens count the real tokens only, so
    # query_start_loc is the rows' layout, not the real query lengths. Only backends that say
    # `supports_verify_graphs` are handed such a layout. 0: the usual ragged layout.
    uniform_query_len: int = 0
    real_query_lens: torch.Tensor | None = None  # int32 [num_seqs] with uniform_query_len
    # Upper bounds of seq_lens the host knows without waiting for the device (None: seq_lens_cpu,
    # which are then exact).
    seq_len_bounds_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def seq_len_bounds(self) -> Sequence[int]:
        return self.seq_len_bounds_cpu if self.seq_len_bounds_cpu is not None else self.seq_lens_cpu


@dataclass
class AttentionMetadata:
    """Where each token of the flattened batch sits in the paged KV cache (BatchLayout's paged
    fields, as the attention backends read them)."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1: padding, not written
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int
    max_seq_len: int
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    is_pure_decode: bool | None = None  # None: one query token per sequence
    uniform_query_len: int = 0  # BatchLayout's: a verify graph's rows per sequence
    real_query_lens: torch.Tensor | None = None

    def __post_init__(self):
        if self.is_pure_decode is None:
            self.is_pure_decode = self.max_query_len == 1

    @classmethod
    def of(cls, layout: BatchLayout) -> "AttentionMetadata":
        return cls(layout.slot_mapping, layout.block_tables, layout.seq_lens, layout.query_start_loc,
                   layout.max_query_len, layout.max_seq_len, layout.seq_lens_cpu, layout.query_lens_cpu,
                   layout.is_pure_decode, layout.uniform_query_len, layout.real_query_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class ForwardContext:
    layout: BatchLayout
    metadata: dict[str, object]  # cache kind -> what its backend built from the layout
    backends: dict[str, "CacheBackend"]  # cache kind -> backend


_current: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext):
    global _current
    if _current is not None:
        raise RuntimeError("forward contexts do not nest: one forward pass at a time")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: layers run only inside ModelRunner's forward pass")
    return _current
