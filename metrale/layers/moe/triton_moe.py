"""The experts' SwiGLU as two grouped GEMMs, one Triton launch each for all experts.

The idea is vLLM's fused_moe; the code is ours. Each (token, k) pair is an *assignment*
a = token * top_k + k. Assignments are sorted by expert and each expert's run padded to a
multiple of BLOCK_M (`kernels/moe_align.py`), so every BLOCK_M-row tile of the sorted list
belongs to one expert. A program computes one [BLOCK_M, BLOCK_N] tile of

    GEMM 1: inter[a]  = hidden[a // top_k] @ w13[e]^T                 (N = 2 * I, K = H)
    GEMM 2: out[a]    = silu(gate) * up  [a] @ w2[e]^T * weight[a]     (N = H, K = I)

gathering its A rows through the sorted ids and scattering C rows back to assignment order;
padding rows and assignments of experts outside this rank's range are never written (out stays
zero there). The per-token sum over k is a plain reduction. Shapes are bounded without reading
the routing on the host (no device sync), which keeps the path CUDA-graph friendly.
"""

from __future__ import annotations

import torch

from metrale.kernels import tl, triton
from metrale.kernels.activation import silu_and_mul
from metrale.kernels.moe_align import align_assignments
from metrale.layers.activation import clamp_swiglu


@triton.jit(do_not_specialize=["num_assign"])  # varies every step: no recompiles
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weight_ptr, sorted_ids_ptr, block_expert_ptr,
                         N, K, num_assign, a_row_divisor,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         MUL_WEIGHT: tl.constexpr, IEEE_FP32: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid: (num_tiles * cdiv(N, BLOCK_N),); C[a, n] = sum_k A[a // a_row_divisor, k] * B[e, n, k].
    pid = tl.program_id(0)
    # Builtins only (no tl.cdiv / tl.zeros, which are @jit helpers of triton.language): those break
    # under the interpreter when triton was imported before TRITON_INTERPRET was set.
    num_n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = pid // num_n_tiles, pid % num_n_tiles
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_mask = assign < num_assign
    a_row = assign // a_row_divisor
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_mask = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE_FP32:  # float32 models get float32 products, not TF32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + assign, mask=row_mask, other=0.0)[:, None]
    c_ptrs = c_ptr + assign[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _grouped_gemm(a, b, c, weights, sorted_ids, block_expert, a_row_divisor, block_m, block_n, block_k):
    num_assign = c.shape[0]
    n, k = b.shape[1], b.shape[2]
    grid = (block_expert.shape[0] * triton.cdiv(n, block_n),)
    _grouped_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, sorted_ids, block_expert,
        n, k, num_assign, a_row_divisor,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        MUL_WEIGHT=weights is not None, IEEE_FP32=a.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def _block_sizes(num_assign: int, num_experts: int) -> tuple[int, int, int]:
    # Small batches (decode) spread over many experts waste most of a tall tile on padding.
    block_m = 16 if num_assign <= 2 * num_experts * 16 else 64
    return block_m, 64, 32


def fused_experts_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, expert_start: int = 0,
                         block_sizes: tuple[int, int, int] | None = None,
                         swiglu_limit: float | None = None) -> torch.Tensor:
    """Same contract as `fused_experts_reference`: hidden [T, H] -> [T, H]."""
    num_tokens, top_k = topk_ids.shape
    num_local, two_i, _ = w13.shape
    num_assign = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    block_m, block_n, block_k = block_sizes or _block_sizes(num_assign, num_local)
    sorted_ids, block_expert = align_assignments(topk_ids, block_m, num_local, expert_start)
    inter = torch.empty((num_assign, two_i), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, inter, None, sorted_ids, block_expert, top_k, block_m, block_n, block_k)
    # Rows of foreign assignments hold garbage here; GEMM 2 never reads them.
    act = silu_and_mul(inter if swiglu_limit is None else clamp_swiglu(inter, swiglu_limit))
    out = torch.zeros((num_assign, hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(act, w2, out, weights, sorted_ids, block_expert, 1, block_m, block_n, block_k)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
