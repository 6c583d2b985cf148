"""The experts' SwiGLU in plain PyTorch: a loop over the experts that received tokens.

Exact and simple; it is the CPU path and the ground truth the Triton kernel is tested against.
The experts are visited in increasing id order and their outputs accumulated into the result
one after another, as transformers does, so float32 results match it closely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.layers.activation import clamp_swiglu


def fused_experts_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, expert_start: int = 0,
                            swiglu_limit: float | None = None) -> torch.Tensor:
    """hidden [T, H]; w13 [E_local, 2 * I, H] (gate rows then up rows); w2 [E_local, H, I];
    topk_weights / topk_ids [T, k] with global ids. Experts outside
    [expert_start, expert_start + E_local) contribute nothing. `swiglu_limit`: gate and up
    clamped first (clamp_swiglu). Returns [T, H]."""
    out = torch.zeros_like(hidden)
    local_ids = topk_ids - expert_start
    local = (local_ids >= 0) & (local_ids < w13.shape[0])
    for expert in torch.unique(local_ids[local]).tolist():
        token_idx, k_pos = torch.where(local_ids == expert)
        gate_up = F.linear(hidden[token_idx], w13[expert])
        if swiglu_limit is not None:
            gate_up = clamp_swiglu(gate_up, swiglu_limit)
        gate, up = gate_up.chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, expert_out.to(out.dtype))
    return out
