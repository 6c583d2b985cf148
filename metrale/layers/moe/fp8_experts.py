"""The experts' SwiGLU over FP8 block-scaled expert weights: the PyTorch reference and the dispatcher.

Weights (what an FP8 FusedMoE holds; the scales as in `metrale.kernels.fp8_math`):

    w13        float8_e4m3fn [E_local, 2I, H]   rows [0, I) gate (w1), [I, 2I) up (w3)
    w13_scale  float32 [E_local, ceil(2I / group_n13), ceil(H / group_k)]
    w2         float8_e4m3fn [E_local, H, I]    down
    w2_scale   float32 [E_local, ceil(H / group_n2), ceil(I / group_k)]

with w13[e][n, k] ~= w13[e][n, k].float() * w13_scale[e, n // group_n13, k // group_k] (w2 likewise).
The scale rows run over all 2I rows of w13, gate and up together: group_n13 is the checkpoint's
block (128) where gate and up are each block-aligned, or 1 where a block would straddle them.
Everything else is `metrale.layers.moe.reference.fused_experts_reference`'s contract: hidden
[T, H] in the model dtype, topk_weights / topk_ids [T, k] with global ids, assignments to experts
outside [expert_start, expert_start + E_local) contribute zero, -> [T, H] in the model dtype.

activation_group: None keeps the GEMM inputs in the model dtype (W8A16). An int quantizes both
GEMMs' inputs (hidden for GEMM 1, silu(gate) * up for GEMM 2) per token and per group of that
many features, as `fp8_math.fake_quantize_activation` does (W8A8). Decode-sized batches take the
small-batch GEMVs, which are W8A16 whatever activation_group says: at those sizes the weights'
bytes set the time and the activations are tiny, so quantizing them would only lose precision.

Numerics of the reference: each linear is `fp8_math.fp8_linear_reference` (float32 on the
dequantized weight, rounded to the model dtype: where F.linear in the model dtype rounds), the
rest rounds as `fused_experts_reference` does (silu(gate) * up in the model dtype, times the
routing weight, accumulated into the output one expert after another in increasing id order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.kernels import use_triton
from metrale.kernels.fp8_math import fp8_linear_reference


def fused_experts_fp8_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                                w2_scale: torch.Tensor, group_n13: int, group_n2: int, group_k: int,
                                topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_start: int = 0,
                                activation_group: int | None = None) -> torch.Tensor:
    """The expert loop of `fused_experts_reference` on dequantized weights (see the module
    docstring). Only the experts that received tokens are dequantized. Reads the routing on the
    host: the CPU path and the ground truth, not for CUDA graphs."""
    out = torch.zeros_like(hidden)
    local_ids = topk_ids - expert_start
    local = (local_ids >= 0) & (local_ids < w13.shape[0])
    for expert in torch.unique(local_ids[local]).tolist():
        token_idx, k_pos = torch.where(local_ids == expert)
        gate_up = fp8_linear_reference(hidden[token_idx], w13[expert], w13_scale[expert], group_n13, group_k,
                                       activation_group=activation_group)
        gate, up = gate_up.chunk(2, dim=-1)
        y = fp8_linear_reference(F.silu(gate) * up, w2[expert], w2_scale[expert], group_n2, group_k,
                                 activation_group=activation_group)
        out.index_add_(0, token_idx, (y * topk_weights[token_idx, k_pos, None]).to(out.dtype))
    return out


def fused_experts_fp8(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                      w2_scale: torch.Tensor, group_n13: int, group_n2: int, group_k: int,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_start: int = 0,
                      activation_group: int | None = None) -> torch.Tensor:
    """hidden [T, H] -> [T, H]: the reference where `use_triton(hidden)` is false; otherwise, as
    FusedMoE chooses for bf16 weights (`use_small_batch`), the small-batch W8A16 GEMVs for
    decode-sized batches and the grouped GEMMs (W8A8, or W8A16 without an activation_group) for
    larger ones. The Triton paths read nothing on the host: CUDA-graph capturable."""
    if not use_triton(hidden):
        return fused_experts_fp8_reference(hidden, w13, w2, w13_scale, w2_scale, group_n13, group_n2, group_k,
                                           topk_weights, topk_ids, expert_start, activation_group)
    # Imported here: the kernel modules are re-decorated when tests switch on the interpreter.
    from metrale.kernels.moe_gemv import use_small_batch

    if use_small_batch(hidden.shape[0], w13.shape[1] // 2):
        from metrale.kernels.fp8_moe_gemv import fused_experts_fp8_small_batch_triton

        return fused_experts_fp8_small_batch_triton(hidden, w13, w2, w13_scale, w2_scale, group_n13, group_n2,
                                                    group_k, topk_weights, topk_ids, expert_start)
    from metrale.kernels.fp8_moe_gemm import fused_experts_fp8_triton

    return fused_experts_fp8_triton(hidden, w13, w2, w13_scale, w2_scale, group_n13, group_n2, group_k,
                                    topk_weights, topk_ids, expert_start, activation_group)
