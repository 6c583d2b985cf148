"""Softmax top-k routing in one launch: router logits [tokens, experts] -> the top-k experts of
each token and their weights (renormalised to sum to one when asked), for Qwen-style MoE layers.
Reference: `metrale/layers/moe/routing.py::select_experts` (softmax scoring, no correction bias).

One program per token; the whole row of experts (up to MAX_EXPERTS) fits one block. Numerics:
softmax in float32 as exp(x - max) / sum; the k largest probabilities are taken largest first,
the lowest expert id winning a tie; renormalisation divides them by their float32 sum; the
weights are rounded once to the output dtype. It replaces the five launches of the PyTorch
path (softmax, top-k, sum, divide, cast), which at batch 1 cost more than the arithmetic.
"""

from __future__ import annotations

import torch

from metrale.kernels import pdl_args, pdl_wait, tl, triton

MAX_EXPERTS = 1024
MAX_TOP_K = 16


@triton.jit(do_not_specialize=["n_rows"])
def _softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, n_rows, num_experts, stride_row,
                         TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                         RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    x = tl.load(logits_ptr + row * stride_row + e, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
    probs = tl.where(valid, p / tl.sum(p, axis=0), -1.0)  # -1: never chosen
    k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], tl.float32)
    top_i = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        index = tl.min(tl.where(probs == best, e, BLOCK_E), axis=0)  # the lowest id among equals
        top_w = tl.where(k == j, best, top_w)
        top_i = tl.where(k == j, index.to(tl.int64), top_i)
        probs = tl.where(e == index, -1.0, probs)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    out = row * TOP_K + k
    tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=k < TOP_K)
    tl.store(ids_ptr + out, top_i, mask=k < TOP_K)


def supports(num_experts: int, top_k: int) -> bool:
    return num_experts <= MAX_EXPERTS and top_k <= MAX_TOP_K


def softmax_topk_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                        weight_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (rows may be strided) -> (weights [T, k] in weight_dtype, ids int64 [T, k])."""
    tokens, experts = router_logits.shape
    assert router_logits.stride(1) == 1 and supports(experts, top_k), (router_logits.shape, top_k)
    weights = torch.empty((tokens, top_k), dtype=weight_dtype, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens:
        block_e = max(triton.next_power_of_2(experts), 16)
        _softmax_topk_kernel[(tokens,)](router_logits, weights, ids, tokens, experts, router_logits.stride(0),
                                        TOP_K=top_k, BLOCK_K=max(triton.next_power_of_2(top_k), 2), BLOCK_E=block_e,
                                        RENORMALIZE=renormalize, num_warps=4 if block_e <= 512 else 8,
                                        **pdl_args())
    return weights, ids
