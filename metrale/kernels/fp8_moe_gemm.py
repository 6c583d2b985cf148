"""The experts' SwiGLU over FP8 block-scaled weights as two grouped GEMMs (prefill-sized batches).

Contract: `metrale.layers.moe.fp8_experts.fused_experts_fp8_reference` (weights float8_e4m3fn
with float32 scales per [group_n, group_k] block; activation_group int -> W8A8, None -> W8A16).

Layout as in `metrale.layers.moe.triton_moe`: assignment a = token * top_k + j; assignments
sorted by local expert and each expert's run padded to a multiple of BLOCK_M (`align_assignments`,
reused), so each BLOCK_M-row tile of the sorted list belongs to one expert; A rows are gathered
through the sorted ids, C rows scattered back to assignment order; padding rows and other ranks'
assignments are never written (out stays zero there). No host sync: CUDA-graph capturable.

    W8A8:   hq, hs   = quant(hidden)                       once per token (T rows, not T * k),
                                                            `fp8_quant.quantize_activation`
            inter[a] = (hq[a // k] @ w13[e]^T)              GEMM 1, N = 2I, K = H
            aq, as   = quant(silu(gate) * up)               one fused pass over inter
            out[a]   = (aq[a] @ w2[e]^T) * weight[a]         GEMM 2, N = H, K = I
    W8A16:  the same with hidden and silu_and_mul(inter) as they are (model dtype).

Scales. BLOCK_K divides group_k and activation_group (a group of at least K features is one
scale column and bounds nothing), so a K-tile lies in one weight scale column and one activation
group; the tile's product is scaled as it is accumulated:

    acc[m, n] += dot(A_tile, w_tile)[m, n] * a_scale[row m, kt] * w_scale[e, n // group_n, kt]

(float32 accumulation; a_scale is 1 in W8A16). The weight scale is gathered per output column,
so any group_n works: 128-row blocks, one row (group_n = 1), blocks straddling gate and up; where
group_n is a multiple of BLOCK_N (checkpoints' [128, 128] blocks) the tile lies in one scale row
and loads one scalar per K-tile instead (W_SCALE_TILE: fewer registers, see the configs). W8A8
multiplies fp8 by fp8 on the tensor cores; W8A16 converts the fp8 weight tile to the activation
dtype in registers (exact: every e4m3 value is a bf16, fp16 and fp32 value), so the scale is the
only thing between the stored weight and the float32 product.

GEMM 2's input is quantized where it is computed (`_silu_mul_quant_kernel`): x = silu(gate) * up,
rounded as `silu_and_mul` rounds (silu to the model dtype, then the product), then quantized as
`fp8_quant` does, bit for bit `fp8_math.quantize_activation`: per group of activation_group
features scale = max(amax / 448, MIN_SCALE), q = clamp(x / scale, +-448) rounded to nearest-even
e4m3, both divisions correctly rounded (div_rn). Rows of other ranks' assignments are skipped.

Rounding otherwise as the reference: GEMM 1's output in the model dtype (F.linear's output),
GEMM 2's rounded to it after the K-sum, times the routing weight in fp32, rounded again; the sum
over the k experts in fp32 (torch's sum), rounded once (the reference rounds after each expert).

Tile configs (`fp8_moe_gemm_config`) are a pure function of the shapes, no autotuning:
deterministic and one compiled variant per layer shape and tile size, measured on an H200.

Under the CPU interpreter (triton 3.9) bf16 `tl.dot` multiplies the raw uint16 storage, so bf16
W8A16 takes float32 dots there (F32_DOT; the products are exact either way); fp8 `tl.dot` works
(widened to fp16). Values are rounded onto e4m3's grid in float32 before the cast to fp8, on the
GPU and the interpreter alike: neither of Triton's casts rounds once to nearest-even (fp8_quant.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from metrale.kernels import interpret_mode, tl, triton
from metrale.kernels.activation import silu_and_mul
from metrale.kernels.fp8_quant import quantize_activation, round_to_e4m3
from metrale.kernels.moe_align import align_assignments
from metrale.kernels.fp8_math import FP8_DTYPE, FP8_MAX, MIN_SCALE


class Fp8MoeGemmConfig(NamedTuple):
    block_m: int  # rows (assignments) per tile; the alignment of every expert's run
    block_n: int  # output columns per tile
    block_k: int  # K per step: divides group_k and activation_group
    num_warps: int
    num_stages: int  # software pipeline depth (the interpreter ignores it)


_FP8_MAX = tl.constexpr(FP8_MAX)  # fp8_math's constants, as the kernels read them
_MIN_SCALE = tl.constexpr(MIN_SCALE)


def _pow2_divisor(n: int) -> int:
    """The largest power of two dividing n (n > 0)."""
    return n & -n


def k_span(k: int, *groups: int | None) -> int | None:
    """The K span a tile must stay inside: the gcd of the scale groups narrower than k (None:
    no activation scale; a group of >= k features is one scale column), None when nothing bounds it."""
    bounds = [g for g in groups if g is not None and g < k]
    return math.gcd(*bounds) if bounds else None


def fp8_moe_gemm_config(num_assign: int, n: int, k: int, num_experts: int, k_group: int | None) -> Fp8MoeGemmConfig:
    """The tiles of one grouped GEMM of `num_assign` assignments over `num_experts` local experts,
    C [*, n] = A [*, k] @ W[e]^T; k_group is the span over which both scales are constant (`k_span`).

        rows per expert r = num_assign / num_experts   block_m 16 below 16 rows per expert, else 64
        block_n   128 from 64 rows per expert, else 64; at most n rounded up to a power of two, at least 16
        block_k   128, at most k_group's largest power-of-two divisor and k rounded up to a power of two
                  (at least 16, tl.dot's least K: the groups must be multiples of 16)
        4 warps, 3 stages

    Measured on an H200 at Qwen3-30B-A3B-FP8's shapes (128 experts, top-8, hidden 2048, intermediate
    768, [128, 128] blocks; benchmarks/fp8_moe_sweep.py, both GEMMs of a layer, us): 64 tokens
    16 x 64 272; 256 tokens 64 x 64 312 (16 x 64: 327); 512 tokens 64 x 64 335 (32 x 64: 429);
    2048 tokens 64 x 128 633 (128 x 128 at 8 warps: 704); 4096 tokens 64 x 128 982 (1068); the bf16
    grouped GEMM took 576, 608, 692, 947 and 1526. 128-row tiles were slower at every size.
    block_m is a function of the routing size only, the same for both GEMMs of a call, as their
    shared alignment requires."""
    rows = max(1, num_assign // max(1, num_experts))
    block_m = 16 if rows < 16 else 64
    block_n = max(16, min(128 if rows >= 64 else 64, triton.next_power_of_2(n)))
    block_k = min(128, _pow2_divisor(k_group) if k_group else 128, max(16, triton.next_power_of_2(k)))
    if block_k < 16:
        raise ValueError(f"the scale groups ({k_group}) must be multiples of 16: tl.dot's K is at least 16")
    return Fp8MoeGemmConfig(block_m, block_n, block_k, num_warps=4, num_stages=3)


@triton.jit(do_not_specialize=["num_assign"])  # varies every step: no recompiles
def _fp8_grouped_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, c_ptr, weight_ptr, sorted_ids_ptr, block_expert_ptr,
    N, K, num_assign, a_row_divisor, group_n, group_k, a_group,
    stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    A_FP8: tl.constexpr, W_SCALE_TILE: tl.constexpr, MUL_WEIGHT: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # grid: (num_tiles * cdiv(N, BLOCK_N),). C[a, n] = sum_k A[a // a_row_divisor, k] * W[e, n, k], both times
    # their scales (A's in W8A8 only). Rows of A, w, C and of the scales are contiguous.
    pid = tl.program_id(0)
    # Builtins only (no tl.cdiv / tl.zeros, @jit helpers that break under the interpreter when
    # triton was imported before TRITON_INTERPRET was set), as in triton_moe.
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
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    if W_SCALE_TILE:  # the N tile lies in one scale row (group_n a multiple of BLOCK_N)
        ws_ptrs = w_scale_ptr + expert * stride_se + (pid_n * BLOCK_N // group_n) * stride_sn
    else:  # the scale row of every output column (columns past N read the last row's)
        ws_ptrs = w_scale_ptr + expert * stride_se + (tl.minimum(offs_n, N - 1) // group_n)[None, :] * stride_sn
    as_ptrs = a_scale_ptr + a_row * stride_asm
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kt in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k0 = kt * BLOCK_K
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        w_scale = tl.load(ws_ptrs + k0 // group_k)  # a scalar, or [1, BLOCK_N]
        if A_FP8:
            a_scale = tl.load(as_ptrs + k0 // a_group, mask=row_mask, other=0.0)
            acc += tl.dot(a, w) * (a_scale[:, None] * w_scale)
        elif F32_DOT:  # float32 models get float32 products, not TF32 (and bf16 under the interpreter)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee") * w_scale
        else:
            acc += tl.dot(a, w.to(a.dtype)) * w_scale
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = c_ptr.dtype.element_ty
    if MUL_WEIGHT:  # F.linear's output in the model dtype, times the routing weight
        weight = tl.load(weight_ptr + assign, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc.to(dtype).to(tl.float32) * weight[:, None]
    c_ptrs = c_ptr + assign[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(dtype), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _silu_mul_quant_kernel(
    x_ptr, ids_ptr, q_ptr, s_ptr, d, group, num_groups, expert_start, num_local,
    stride_x, stride_q, stride_s,
    BLOCK_G: tl.constexpr, GROUP: tl.constexpr,
):
    # grid: (num_assign, cdiv(num_groups, BLOCK_G)). Program (a, b) quantizes groups [b * BLOCK_G, +BLOCK_G)
    # of silu(x[a, :d]) * x[a, d:2d] as one [BLOCK_G, GROUP] tile (GROUP: group rounded up to a power of
    # two, the rest masked), so each group's amax is a reduction along the tile's second axis.
    row = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + row).to(tl.int64) - expert_start
    if (expert < 0) | (expert >= num_local):  # another rank's assignment: GEMM 2 never reads its row
        return
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    within = tl.arange(0, GROUP)
    cols = groups[:, None] * group + within[None, :]
    mask = (within < group)[None, :] & (cols < d)
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # rounded as silu_and_mul rounds
    x = (silu * up).to(dtype).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), _FP8_MAX), _MIN_SCALE)
    q = tl.minimum(tl.maximum(tl.div_rn(x, scale[:, None]), -_FP8_MAX), _FP8_MAX)
    q = round_to_e4m3(q)  # Triton's fp8 casts do not round once to nearest-even (fp8_quant.py)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s + groups, scale, mask=groups < num_groups)


def _silu_mul_quantize(inter, group, ids, expert_start, num_local):
    """inter [A, 2d] (gate | up of assignment a on row a, ids [A] their experts) ->
    (float8_e4m3fn [A, d], float32 scale [A, ceil(d / group)]); other ranks' rows unwritten."""
    rows, d = inter.shape[0], inter.shape[1] // 2
    group = min(group, d)
    num_groups = triton.cdiv(d, group)
    q = torch.empty((rows, d), dtype=FP8_DTYPE, device=inter.device)
    scale = torch.empty((rows, num_groups), dtype=torch.float32, device=inter.device)
    group_p2 = triton.next_power_of_2(group)
    block_g = min(triton.next_power_of_2(num_groups), max(1, 4096 // group_p2))  # tiles of <= 4096 elements
    _silu_mul_quant_kernel[(rows, triton.cdiv(num_groups, block_g))](
        inter, ids, q, scale, d, group, num_groups, expert_start, num_local,
        inter.stride(0), q.stride(0), scale.stride(0),
        BLOCK_G=block_g, GROUP=group_p2, num_warps=4)
    return q, scale


def _grouped_gemm(a, a_scale, a_group, w, w_scale, group_n, group_k, c, weights, sorted_ids, block_expert,
                  a_row_divisor, cfg):
    n, k = w.shape[1], w.shape[2]
    a_fp8 = a_scale is not None
    grid = (block_expert.shape[0] * triton.cdiv(n, cfg.block_n),)
    _fp8_grouped_gemm_kernel[grid](
        a, a_scale if a_fp8 else w_scale, w, w_scale, c, weights if weights is not None else c,
        sorted_ids, block_expert,
        n, k, c.shape[0], a_row_divisor, group_n, group_k, a_group if a_fp8 else group_k,
        a.stride(0), a_scale.stride(0) if a_fp8 else 0, w.stride(0), w.stride(1), w_scale.stride(0),
        w_scale.stride(1), c.stride(0),
        A_FP8=a_fp8, W_SCALE_TILE=group_n % cfg.block_n == 0, MUL_WEIGHT=weights is not None,
        F32_DOT=a.dtype == torch.float32 or (interpret_mode() and a.dtype == torch.bfloat16),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _check_args(hidden, w13, w2, w13_scale, w2_scale, group_n13, group_n2, group_k, topk_weights, topk_ids):
    num_tokens, hidden_size = hidden.shape
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    assert w13.dtype == w2.dtype == FP8_DTYPE, (w13.dtype, w2.dtype)
    assert w13.shape == (num_local, 2 * inter, hidden_size) and w2.shape == (num_local, hidden_size, inter), \
        (tuple(w13.shape), tuple(w2.shape), hidden_size)
    assert w13_scale.shape == (num_local, triton.cdiv(2 * inter, group_n13), triton.cdiv(hidden_size, group_k)), \
        (tuple(w13_scale.shape), group_n13, group_k)
    assert w2_scale.shape == (num_local, triton.cdiv(hidden_size, group_n2), triton.cdiv(inter, group_k)), \
        (tuple(w2_scale.shape), group_n2, group_k)
    assert w13_scale.dtype == w2_scale.dtype == torch.float32, (w13_scale.dtype, w2_scale.dtype)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens, \
        (tuple(topk_ids.shape), tuple(topk_weights.shape), num_tokens)
    assert hidden.dtype in (torch.bfloat16, torch.float16, torch.float32), hidden.dtype
    assert all(t.stride(-1) == 1 for t in (w13, w2, w13_scale, w2_scale)), "weight and scale rows must be contiguous"


def fused_experts_fp8_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                             w2_scale: torch.Tensor, group_n13: int, group_n2: int, group_k: int,
                             topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_start: int = 0,
                             activation_group: int | None = None, *,
                             config: Fp8MoeGemmConfig | None = None) -> torch.Tensor:
    """Same contract as `fused_experts_fp8_reference`: hidden [T, H] -> [T, H], always via Triton.
    `config` replaces both GEMMs' `fp8_moe_gemm_config` (tests, benchmarks): its block_k must
    divide group_k and activation_group."""
    _check_args(hidden, w13, w2, w13_scale, w2_scale, group_n13, group_n2, group_k, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_local, two_i, hidden_size = w13.shape
    num_assign = num_tokens * top_k
    if num_assign == 0 or hidden_size == 0:
        return torch.zeros_like(hidden)
    inter_size = two_i // 2
    span1, span2 = k_span(hidden_size, group_k, activation_group), k_span(inter_size, group_k, activation_group)
    cfg1 = config or fp8_moe_gemm_config(num_assign, two_i, hidden_size, num_local, span1)
    cfg2 = config or fp8_moe_gemm_config(num_assign, hidden_size, inter_size, num_local, span2)
    for span, cfg in ((span1, cfg1), (span2, cfg2)):  # a K tile within one group of each scale
        assert span is None or span % cfg.block_k == 0, (cfg, group_k, activation_group)
    sorted_ids, block_expert = align_assignments(topk_ids, cfg1.block_m, num_local, expert_start)
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()

    inter = torch.empty((num_assign, two_i), dtype=hidden.dtype, device=hidden.device)
    if activation_group is None:
        a, a_scale = hidden, None
    else:
        a, a_scale = quantize_activation(hidden, activation_group)
    _grouped_gemm(a, a_scale, activation_group, w13, w13_scale, group_n13, group_k, inter, None,
                  sorted_ids, block_expert, top_k, cfg1)
    # Rows of other ranks' assignments are never written: garbage that GEMM 2 never reads (W8A16's
    # silu_and_mul passes it through, the fused quantization skips those rows).
    if activation_group is None:
        act, act_scale = silu_and_mul(inter), None
    else:
        ids = topk_ids.reshape(-1).contiguous()
        act, act_scale = _silu_mul_quantize(inter, activation_group, ids, expert_start, num_local)
    out = torch.zeros((num_assign, hidden_size), dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(act, act_scale, activation_group, w2, w2_scale, group_n2, group_k, out, weights,
                  sorted_ids, block_expert, 1, cfg2)
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1)
