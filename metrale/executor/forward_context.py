"""The one piece of per-step state layers may read: published by the model runner for the
duration of a forward pass, through a context manager that cannot nest."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each token of the flattened batch sits in the paged KV cache.

    Sequence i owns query rows query_start_loc[i]..query_start_loc[i+1]; those are the LAST
    query_len_i positions of a context of seq_lens[i] tokens (cached prefix + new tokens).
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1: padding, not written
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int
    max_seq_len: int
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    attn_backend: object  # metrale.layers.attention.backend.AttentionBackend


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
