"""Assignments of a MoE layer sorted by expert and padded to whole tiles, on the device.

Each (token, k) pair is an assignment a = token * top_k + k. The grouped GEMMs (bf16:
layers/moe/triton_moe.py; FP8: kernels/fp8_moe_gemm.py) need every BLOCK_M-row tile of the
sorted list to belong to one expert; this builds that list without reading the routing on the
host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from metrale.kernels import triton


def align_assignments(topk_ids: torch.Tensor, block_m: int, num_local_experts: int,
                      expert_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (sorted_ids int32 [max_padded], block_expert int32 [max_padded // block_m]).

    sorted_ids lists assignment indices grouped by local expert, each group padded to a multiple
    of block_m with the sentinel `topk_ids.numel()`; block_expert[b] is the local expert of tile b,
    or -1 for tiles past the last group. max_padded bounds every routing of this many assignments."""
    device, num_experts = topk_ids.device, num_local_experts
    local = topk_ids.flatten().long() - expert_start
    num_assign = local.numel()
    key = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # foreign experts sort last
    # scatter_add, not bincount: CUDA bincount reads the max on the host, which a graph cannot capture.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded_counts, 0)
    unpadded_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    expert_of = sorted_key.clamp(max=num_experts - 1)
    dest = padded_end[expert_of] - padded_counts[expert_of] + (
        torch.arange(num_assign, device=device) - unpadded_start[expert_of])
    max_padded = triton.cdiv(num_assign + num_experts * (block_m - 1), block_m) * block_m
    dest = torch.where(sorted_key < num_experts, dest, max_padded)  # foreign ones go to a dump slot
    sorted_ids = torch.full((max_padded + 1,), num_assign, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    tile_start = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids[:max_padded], block_expert
