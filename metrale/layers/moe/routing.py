"""Router logits -> the top-k experts of each token and their weights.

Two scoring families:

- "softmax" (Qwen2/3-MoE, Mixtral): probabilities = softmax(logits) in float32, the k largest are
  chosen, and with `renormalize` (`norm_topk_prob`) divided by their sum.
- "sigmoid" with an `e_score_correction_bias` (MiniMax-M2, DeepSeek-V3 style): scores =
  sigmoid(logits) in float32; the bias is added *for the choice only* (it balances load); the
  weights are the unbiased sigmoid scores of the chosen experts, renormalised to sum to one.
"""

from __future__ import annotations

import torch

from metrale.kernels import moe_routing, use_triton

SCORING_FUNCTIONS = ("softmax", "sigmoid")


def select_experts(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True,
                   correction_bias: torch.Tensor | None = None,
                   weight_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [tokens, num_experts] -> (topk_weights [tokens, k] in weight_dtype, rounded once
    from float32; topk_ids int64 [tokens, k]).

    Ids are global expert ids; which rank holds an expert is the layer's business, not the router's.
    On CUDA, softmax routing without a correction bias takes one fused launch (kernels/moe_routing.py)."""
    if (scoring == "softmax" and correction_bias is None and use_triton(router_logits)
            and moe_routing.supports(router_logits.shape[-1], top_k)):
        return moe_routing.softmax_topk_triton(router_logits, top_k, renormalize, weight_dtype)
    if scoring == "softmax":
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(router_logits.float())
    else:
        raise ValueError(f"unknown MoE scoring function {scoring!r}; expected one of {SCORING_FUNCTIONS}")
    if correction_bias is None:
        topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1)
    else:
        # The reference takes an unsorted top-k here; the chosen set is the same either way.
        _, topk_ids = torch.topk(scores + correction_bias.float(), top_k, dim=-1, sorted=False)
        topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(weight_dtype), topk_ids
