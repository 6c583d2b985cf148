"""The Gated DeltaNet backend interface: the causal conv1d over each sequence (with its saved
inputs) and the gated delta rule (with its recurrent state), both over per-request state slots
(layouts in metrale/kernels/reference_linear_attention.py). The PyTorch backend is the reference;
the Triton backend is tested against it.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from dataclasses import dataclass

import torch

from metrale.layers.cache_backend import CacheBackend
from metrale.layers.forward_context import BatchLayout, DraftStates


@dataclass
class GDNMetadata:
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    state_slots: torch.Tensor  # int32 [num_seqs]
    has_initial_state: torch.Tensor  # int32 [num_seqs]
    # One token per sequence, every one continuing from its state: the step kernels apply.
    is_pure_decode: bool
    query_start_cpu: list[int]  # query_start_loc on the host (no sync to read it)
    # A verify step: where the states after each drafted position go (draft_states.py).
    drafts: DraftStates | None = None

    @classmethod
    def of(cls, layout: BatchLayout) -> "GDNMetadata":
        return cls(layout.query_start_loc, layout.state_slots, layout.has_initial_state, layout.is_pure_decode,
                   [0, *itertools.accumulate(layout.query_lens_cpu)], layout.drafts)


class GDNBackend(CacheBackend):
    kind = "gdn"

    def build_metadata(self, layout: BatchLayout) -> GDNMetadata:
        return GDNMetadata.of(layout)

    @abstractmethod
    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
             metadata: GDNMetadata) -> torch.Tensor:
        """silu(causal depthwise conv) of x [num_tokens, channels] (rows may be strided), each
        sequence preceded by its saved inputs; weight [channels, kernel]; updates conv_state (and,
        in a verify step, the drafted positions' scratch rows: draft_states.py)."""

    @abstractmethod
    def delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   A: torch.Tensor, dt_bias: torch.Tensor, recurrent_state: torch.Tensor,
                   metadata: GDNMetadata) -> torch.Tensor:
        """The gated delta rule with decay g = A * softplus(a + dt_bias) (A = -exp(A_log), float32)
        and write strength beta = sigmoid(b); q, k [T, key_heads, key_dim], v [T, value_heads,
        value_dim] -> [T, value_heads, value_dim]; updates recurrent_state (and, in a verify step,
        the drafted positions' scratch rows: draft_states.py)."""
