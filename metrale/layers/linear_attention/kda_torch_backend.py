"""The reference Kimi Delta Attention backend: the PyTorch references, CPU or CUDA (slow and
obviously right; one sequence at a time outside decode)."""

from __future__ import annotations

from metrale.kernels import reference_kda as KDA
from metrale.kernels import reference_linear_attention as R
from metrale.layers.cache_backend import register_backend
from metrale.layers.linear_attention.backend import GDNMetadata
from metrale.layers.linear_attention.draft_states import draft_rows_cpu, keep_draft_conv_states
from metrale.layers.linear_attention.kda_backend import KDABackend


@register_backend
class TorchKDABackend(KDABackend):
    name = "torch"

    def conv(self, x, weight, conv_state, metadata: GDNMetadata):
        if metadata.is_pure_decode:
            return R.causal_conv1d_step(x, weight, None, conv_state, metadata.state_slots)
        if metadata.drafts is not None:
            keep_draft_conv_states(x, weight.dtype, conv_state, metadata.query_start_loc, metadata.state_slots,
                                   metadata.has_initial_state, metadata.drafts)
        return R.causal_conv1d(x, weight, None, conv_state, metadata.query_start_loc, metadata.state_slots,
                               metadata.has_initial_state)

    def delta_rule(self, q, k, v, g, beta, recurrent_state, metadata: GDNMetadata):
        if metadata.is_pure_decode:
            return KDA.kimi_delta_rule_step(q, k, v, g, beta, recurrent_state, metadata.state_slots)
        return KDA.kimi_delta_rule(q, k, v, g, beta, recurrent_state, metadata.query_start_loc,
                                   metadata.state_slots, metadata.has_initial_state,
                                   draft_rows=draft_rows_cpu(metadata.drafts))
