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

from metrale.kernels import pdl_args, pdl_launch_dependents, pdl_wait, tl, triton
from metrale.kernels.arrivals import arrival_counters

MAX_EXPERTS = 1024
MAX_TOP_K = 16


@triton.jit
def _top_k(x, valid, e, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
           RENORMALIZE: tl.constexpr):
    # x [BLOCK_E] float32 logits (valid where e < experts) -> (weights [BLOCK_K] float32, ids
    # [BLOCK_K] int64) of the TOP_K largest softmax probabilities, largest first.
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
    return top_w, top_i


@triton.jit(do_not_specialize=["n_rows"])
def _softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, n_rows, num_experts, stride_row,
                         TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                         RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    x = tl.load(logits_ptr + row * stride_row + e, mask=valid, other=float("-inf")).to(tl.float32)
    top_w, top_i = _top_k(x, valid, e, TOP_K, BLOCK_K, BLOCK_E, RENORMALIZE)
    k = tl.arange(0, BLOCK_K)
    out = row * TOP_K + k
    tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=k < TOP_K)
    tl.store(ids_ptr + out, top_i, mask=k < TOP_K)


@triton.jit
def _router_topk_kernel(x_ptr, w_ptr, logits_ptr, arrivals_ptr, weights_ptr, ids_ptr,
                        hidden_size, num_experts, stride_xm, stride_wn,
                        TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK_H: tl.constexpr, VEC: tl.constexpr,
                        RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    # grid: (tokens, cdiv(E, ROWS)). Program (t, b) computes router logits t, rows b*ROWS.. as
    # F.linear does (fp32 sums, rounded to the model dtype), stores them, and the token's last
    # program to arrive (kernels/arrivals.py) takes the softmax top-k of the whole row.
    t = tl.program_id(0)
    b = tl.program_id(1)
    rows = b * ROWS + tl.arange(0, ROWS)
    rmask = rows < num_experts
    rows_c = tl.minimum(rows, num_experts - 1).to(tl.int64)  # rows past E re-read row E-1
    kk = tl.arange(0, BLOCK_H // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    w_ptrs = w_ptr + rows_c[:, None, None] * stride_wn + kk[None, :, :]
    x_ptrs = x_ptr + t.to(tl.int64) * stride_xm + kk
    acc = tl.zeros([ROWS, BLOCK_H // VEC], tl.float32)
    w = tl.load(w_ptrs, mask=(kk < hidden_size)[None, :, :], other=0.0)  # weights: before the wait
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)  # the experts' stage 1 may launch and wait for the routing
    for k0 in range(0, hidden_size, BLOCK_H):
        kmask = (k0 + kk) < hidden_size
        if k0 > 0:
            w = tl.load(w_ptrs + k0, mask=kmask[None, :, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=kmask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :, :], axis=2)
    logits = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + t.to(tl.int64) * num_experts + rows, logits, mask=rmask)
    tl.debug_barrier()  # every thread's logits stored before the program arrives
    counter = arrivals_ptr + t
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
        tl.store(counter, 0)
        e = tl.arange(0, BLOCK_E)
        valid = e < num_experts
        row = tl.load(logits_ptr + t.to(tl.int64) * num_experts + e, mask=valid, other=float("-inf"),
                      cache_modifier=".cg")
        top_w, top_i = _top_k(row, valid, e, TOP_K, BLOCK_K, BLOCK_E, RENORMALIZE)
        k = tl.arange(0, BLOCK_K)
        out = t.to(tl.int64) * TOP_K + k
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


ROUTER_ROWS = 2  # router rows per program of the fused kernel (E / 2 programs per token)


def router_softmax_topk_triton(hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool,
                               weight_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H] (rows may be strided) and the router's weight [E, H], both in the model dtype
    -> `softmax_topk_triton(F.linear(hidden, router_weight), ...)`, in one launch: the logits are
    summed in fp32 and rounded to the model dtype as F.linear's are (summation order aside)."""
    tokens, hidden_size = hidden.shape
    experts = router_weight.shape[0]
    assert router_weight.shape == (experts, hidden_size) and router_weight.dtype == hidden.dtype, \
        (tuple(router_weight.shape), router_weight.dtype, hidden.dtype)
    assert hidden.stride(1) == 1 and router_weight.stride(1) == 1 and supports(experts, top_k)
    weights = torch.empty((tokens, top_k), dtype=weight_dtype, device=hidden.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=hidden.device)
    if tokens:
        logits = torch.empty((tokens, experts), dtype=torch.float32, device=hidden.device)
        vec = max(1, 16 // hidden.element_size())
        block_h = min(triton.next_power_of_2(hidden_size), 4096 // hidden.element_size())
        block_h = max(block_h, vec)
        blocks = triton.cdiv(experts, ROUTER_ROWS)
        _router_topk_kernel[(tokens, blocks)](
            hidden, router_weight, logits, arrival_counters(hidden.device, tokens), weights, ids,
            hidden_size, experts, hidden.stride(0), router_weight.stride(0),
            TOP_K=top_k, BLOCK_K=max(triton.next_power_of_2(top_k), 2),
            BLOCK_E=max(triton.next_power_of_2(experts), 16), ROWS=ROUTER_ROWS, BLOCK_H=block_h, VEC=vec,
            RENORMALIZE=renormalize, num_warps=max(1, min(8, block_h // (vec * 32))), **pdl_args())
    return weights, ids
