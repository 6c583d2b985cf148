"""Router logits -> the top-k experts of each token and their weights.

Two scoring families:

- "softmax" (Qwen2/3-MoE, Mixtral): probabilities = softmax(logits) in float32, the k largest are
  chosen, and with `renormalize` (`norm_topk_prob`) divided by their sum.
- "sigmoid" with an `e_score_correction_bias` (MiniMax-M2, DeepSeek-V3 style): scores =
  sigmoid(logits) in float32; the bias is added *for the choice only* (it balances load); the
  weights are the unbiased sigmoid scores of the chosen experts, with `renormalize` divided by
  their sum.

Two options on top, DeepSeek-V3's (transformers' DeepseekV3TopkRouter):

- group-limited choice (`num_expert_groups` > 1): the experts are cut into that many equal
  groups of consecutive ids, each group is scored by the sum of its two best choice scores (the
  biased ones), and a token picks its top k experts only among its `topk_groups` best groups;
- `routed_scaling_factor`: the final weights (after any renormalisation) are multiplied by it,
  in float32, before the one rounding to `weight_dtype`.
"""

from __future__ import annotations

import torch

from metrale.kernels import moe_routing, use_triton

SCORING_FUNCTIONS = ("softmax", "sigmoid")


def check_group_limit(num_experts: int, top_k: int, num_expert_groups: int, topk_groups: int) -> None:
    """Raise ValueError when group-limited routing cannot choose top_k experts as the reference does."""
    if num_expert_groups == 1:
        return
    if num_expert_groups < 1 or num_experts % num_expert_groups:
        raise ValueError(f"{num_experts} experts do not split into {num_expert_groups} equal expert groups")
    group_size = num_experts // num_expert_groups
    if group_size < 2:
        raise ValueError(f"expert groups of {group_size} expert(s): groups are scored by their two best experts")
    if not 1 <= topk_groups <= num_expert_groups:
        raise ValueError(f"topk_groups ({topk_groups}) must be between 1 and the number of groups "
                         f"({num_expert_groups})")
    if top_k > topk_groups * group_size:
        raise ValueError(f"top_k ({top_k}) exceeds the {topk_groups * group_size} experts of the "
                         f"{topk_groups} group(s) a token may choose from")


def limit_to_top_groups(choice_scores: torch.Tensor, num_expert_groups: int, topk_groups: int) -> torch.Tensor:
    """choice_scores [tokens, experts] with every expert outside a token's `topk_groups` best
    groups set to -inf; a group's score is the sum of its two best choice scores."""
    tokens, experts = choice_scores.shape
    grouped = choice_scores.view(tokens, num_expert_groups, experts // num_expert_groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    kept_groups = torch.topk(group_scores, topk_groups, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    return grouped.masked_fill(~kept[..., None], float("-inf")).view(tokens, experts)


def select_experts(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True,
                   correction_bias: torch.Tensor | None = None, weight_dtype: torch.dtype = torch.float32,
                   num_expert_groups: int = 1, topk_groups: int = 1,
                   routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [tokens, num_experts] -> (topk_weights [tokens, k] in weight_dtype, rounded once
    from float32; topk_ids int64 [tokens, k]).

    Ids are global expert ids; which rank holds an expert is the layer's business, not the router's.
    On CUDA, plain softmax routing (no correction bias, no groups, no scaling) takes one fused
    launch (kernels/moe_routing.py)."""
    grouped = num_expert_groups > 1
    if (scoring == "softmax" and correction_bias is None and not grouped and routed_scaling_factor == 1.0
            and use_triton(router_logits) and moe_routing.supports(router_logits.shape[-1], top_k)):
        return moe_routing.softmax_topk_triton(router_logits, top_k, renormalize, weight_dtype)
    if scoring == "softmax":
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(router_logits.float())
    else:
        raise ValueError(f"unknown MoE scoring function {scoring!r}; expected one of {SCORING_FUNCTIONS}")
    if correction_bias is None and not grouped:
        topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1)
    else:
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if grouped:
            choice = limit_to_top_groups(choice, num_expert_groups, topk_groups)
        # The reference takes an unsorted top-k here; the chosen set is the same either way.
        _, topk_ids = torch.topk(choice, top_k, dim=-1, sorted=False)
        topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights.to(weight_dtype), topk_ids
