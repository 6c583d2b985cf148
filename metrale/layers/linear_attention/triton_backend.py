"""The Triton Gated DeltaNet backend: the fast path on CUDA.

Pure decode steps (one token per sequence, each with state) take the step kernels, which read
nothing on the host and replay inside CUDA graphs; every other step takes the chunked prefill
kernels over the whole varlen batch (a decode row in a mixed step is a one-token chunk). A verify
step of speculative decoding runs its drafted sequences token by token (the verify kernel), which
keeps their state after each draft (draft_states.py); beside prefill chunks, the chunked kernels
compute the rest of the batch first. Tested against the PyTorch backend (tests/kernels, tests/gpu).
"""

from __future__ import annotations

from metrale.kernels import HAS_TRITON
from metrale.kernels.causal_conv1d import causal_conv1d_step_triton, causal_conv1d_triton
from metrale.kernels.gated_delta_rule import gated_delta_rule_triton
from metrale.kernels.gated_delta_step import (gated_delta_rule_step_triton, gated_delta_rule_verify_triton,
                                               gdn_gating_triton)
from metrale.layers.cache_backend import register_backend
from metrale.layers.linear_attention.backend import GDNBackend, GDNMetadata
from metrale.layers.linear_attention.draft_states import chunk_redirect, keep_draft_conv_states

if not HAS_TRITON:
    raise ImportError("triton is not installed")


@register_backend
class TritonGDNBackend(GDNBackend):
    name = "triton"
    supports_cuda_graphs = True

    def conv(self, x, weight, bias, conv_state, metadata: GDNMetadata):
        if metadata.is_pure_decode:
            return causal_conv1d_step_triton(x, weight, bias, conv_state, metadata.state_slots)
        if metadata.drafts is not None:
            keep_draft_conv_states(x, weight.dtype, conv_state, metadata.query_start_loc, metadata.state_slots,
                                   metadata.has_initial_state, metadata.drafts)
        return causal_conv1d_triton(x, weight, bias, conv_state, metadata.query_start_loc, metadata.state_slots,
                                    metadata.has_initial_state, query_start_cpu=metadata.query_start_cpu)

    def delta_rule(self, q, k, v, a, b, A, dt_bias, recurrent_state, metadata: GDNMetadata):
        if metadata.is_pure_decode:
            return gated_delta_rule_step_triton(q, k, v, a, b, A, dt_bias, recurrent_state, metadata.state_slots)
        drafts = metadata.drafts
        if drafts is not None and drafts.all_continue:  # decodes and verifies only: token by token
            return self._verify(q, k, v, a, b, A, dt_bias, recurrent_state, metadata)
        g, beta = gdn_gating_triton(a, b, A, dt_bias)
        slots, has_state = chunk_redirect(metadata.state_slots, metadata.has_initial_state, drafts)
        out = gated_delta_rule_triton(q, k, v, g, beta, recurrent_state, metadata.query_start_loc, slots, has_state,
                                      query_start_cpu=metadata.query_start_cpu)
        if drafts is not None:  # the drafted sequences again, over the chunked kernel's rows for them
            self._verify(q, k, v, a, b, A, dt_bias, recurrent_state, metadata, out)
        return out

    @staticmethod
    def _verify(q, k, v, a, b, A, dt_bias, recurrent_state, metadata: GDNMetadata, out=None):
        drafts = metadata.drafts
        return gated_delta_rule_verify_triton(q, k, v, a, b, A, dt_bias, recurrent_state, metadata.state_slots,
                                              metadata.has_initial_state, metadata.query_start_loc,
                                              drafts.num_drafts, drafts.state_rows, out)
