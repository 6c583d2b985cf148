"""The reference Gated DeltaNet backend: the PyTorch references, CPU or CUDA (slow and obviously
right; one sequence at a time outside decode)."""

from __future__ import annotations

import torch.nn.functional as F

from metrale.kernels import reference_linear_attention as R
from metrale.layers.cache_backend import register_backend
from metrale.layers.linear_attention.backend import GDNBackend, GDNMetadata
from metrale.layers.linear_attention.draft_states import draft_rows_cpu, keep_draft_conv_states


def gating(a, b, A, dt_bias):
    """(g, beta) as the reference model computes them: g in float32, beta in b's dtype."""
    return A * F.softplus(a.float() + dt_bias), b.sigmoid()


@register_backend
class TorchGDNBackend(GDNBackend):
    name = "torch"

    def conv(self, x, weight, bias, conv_state, metadata: GDNMetadata):
        if metadata.is_pure_decode:
            return R.causal_conv1d_step(x, weight, bias, conv_state, metadata.state_slots)
        if metadata.drafts is not None:
            keep_draft_conv_states(x, weight.dtype, conv_state, metadata.query_start_loc, metadata.state_slots,
                                   metadata.has_initial_state, metadata.drafts)
        return R.causal_conv1d(x, weight, bias, conv_state, metadata.query_start_loc, metadata.state_slots,
                               metadata.has_initial_state)

    def delta_rule(self, q, k, v, a, b, A, dt_bias, recurrent_state, metadata: GDNMetadata):
        g, beta = gating(a, b, A, dt_bias)
        if metadata.is_pure_decode:
            return R.gated_delta_rule_step(q, k, v, g, beta, recurrent_state, metadata.state_slots)
        return R.gated_delta_rule(q, k, v, g, beta, recurrent_state, metadata.query_start_loc, metadata.state_slots,
                                  metadata.has_initial_state, draft_rows=draft_rows_cpu(metadata.drafts))
