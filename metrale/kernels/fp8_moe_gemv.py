"""The routed experts' SwiGLU over FP8 block-scaled weights for decode-sized batches: two GEMV launches (W8A16).

`metrale.kernels.moe_gemv`'s algorithm with float8_e4m3fn expert weights and their float32 block
scales. Contract: `metrale.layers.moe.fp8_experts.fused_experts_fp8_reference` with
activation_group None:

    hidden     [T, H]            model dtype (bf16 / fp16 / fp32); rows may be strided, last dim contiguous
    w13        [E_local, 2I, H]  float8_e4m3fn, rows [0, I) gate, [I, 2I) up; contiguous rows
    w13_scale  [E_local, ceil(2I / group_n13), ceil(H / group_k)] float32, contiguous rows
    w2         [E_local, H, I]   float8_e4m3fn; contiguous rows
    w2_scale   [E_local, ceil(H / group_n2), ceil(I / group_k)] float32, contiguous rows
    topk_ids / topk_weights [T, k], global ids; this rank holds [expert_start, expert_start + E_local)
    -> out     [T, H]            model dtype, a new contiguous tensor

Activations stay in the model dtype (the dispatcher sends decode batches here whatever the
activation_group: at these sizes the weight bytes set the time, and halving them is the gain).

  Stage 1 (`_gate_up_kernel`, grid (T * k, cdiv(I, BLOCK_I))): program (a, b) dots BLOCK_I gate
      rows and the matching up rows of w13[e_a] with hidden[token] over H and writes
      act[a] = silu(gate) * up ([T * k, I], model dtype); other ranks' assignments return at once.
  Stage 2 (`_down_kernel`, grid (T, cdiv(H, BLOCK_N))): program (t, b) reads BLOCK_N rows of w2 of
      all k experts of token t as one [k', BLOCK_N, I-chunk] tile with the k act rows, scales by
      the routing weights and sums over the experts in registers: one store per output element.

Weights are read as in moe_gemv: each thread issues 16-byte loads along a row, here 16 fp8
values ([..., BLOCK_K // VEC, VEC] tiles, the last axis thread-local), widened to fp32 in
registers. VEC divides group_k, so the VEC products a thread sums lie in one scale group: that
partial sum is multiplied by its group's scale (gathered per vector from the scale rows, a few
floats per row that stay in L1) and added to the thread's fp32 accumulator. Rows past the edge
re-read the last row and are dropped at the store, as in moe_gemv.

Numerics: as moe_gemv (rounded where the reference rounds: gate and up after the H-sum, silu,
the product, y after the I-sum, y times the routing weight; the k-sum in fp32, rounded once),
with the weights exact: every product is fp8 value x activation in fp32, times its scale.

Determinism: no split-K, no atomics; the launch config is `fp8_moe_gemv_config` for one-byte
weights, a pure function of (H, I, k), so results are bitwise reproducible and independent of
the batch and of which other tokens are in it.

Programmatic dependent launch as in moe_gemv: stage 1 waits before its first read and lets
stage 2 launch; stage 2 reads the routing, its first w2 chunk and that chunk's scales (weights,
which no kernel writes) before waiting, and the act rows only after.
"""

from __future__ import annotations

import torch

from metrale.kernels import pdl_args, pdl_launch_dependents, pdl_wait, tl, triton
from metrale.kernels.moe_gemv import MoeGemvConfig, chunk_width
from metrale.kernels.fp8_math import FP8_DTYPE


def _vec(block_k: int, group_k: int) -> int:
    """fp8 elements per load: 16 (16 bytes), capped by the chunk and by group_k's largest
    power-of-two divisor, so that one load never straddles two scale groups."""
    return min(16, block_k, group_k & -group_k)


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, s13_ptr, ids_ptr, act_ptr,
    hidden_size, inter_size, expert_start, num_local, group_n, group_k,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am,
    TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    # grid: (num_assign, cdiv(I, BLOCK_I)). act[a, i] = silu(x[t] . W13[e, i]) * (x[t] . W13[e, I + i]),
    # W13 = w13 times its block scales.
    pdl_wait(PDL)  # the routing and hidden come from earlier kernels
    pdl_launch_dependents(PDL)  # stage 2 may start and prefetch its w2 rows
    a = tl.program_id(0)
    expert = tl.load(ids_ptr + a).to(tl.int64) - expert_start
    if (expert < 0) | (expert >= num_local):  # another rank's expert: stage 2 never reads this row
        return
    token = a // TOP_K
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    imask = offs_i < inter_size
    rows = tl.minimum(offs_i, inter_size - 1).to(tl.int64)  # rows past I re-read row I-1: loads stay unmasked
    vec = tl.arange(0, BLOCK_K // VEC)  # a chunk's vectors, one per thread and load
    kk = vec[:, None] * VEC + tl.arange(0, VEC)[None, :]
    w_ptrs = w13_ptr + expert * stride_we + kk[None, :, :]
    g_ptrs = w_ptrs + rows[:, None, None] * stride_wn
    u_ptrs = w_ptrs + (rows + inter_size)[:, None, None] * stride_wn
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xm + kk
    # [BLOCK_I, 1]: the scale rows of the gate and up rows; a vector's column is its first k // group_k
    sg_ptrs = s13_ptr + expert * stride_se + (rows // group_n)[:, None] * stride_sn
    su_ptrs = s13_ptr + expert * stride_se + ((rows + inter_size) // group_n)[:, None] * stride_sn

    acc_g = tl.full([BLOCK_I, BLOCK_K // VEC], 0.0, tl.float32)
    acc_u = tl.full([BLOCK_I, BLOCK_K // VEC], 0.0, tl.float32)
    k_full = (hidden_size // BLOCK_K) * BLOCK_K
    for k0 in range(0, k_full, BLOCK_K):
        g = tl.load(g_ptrs + k0).to(tl.float32)
        u = tl.load(u_ptrs + k0).to(tl.float32)
        x = tl.load(x_ptrs + k0).to(tl.float32)[None, :, :]
        cols = ((k0 + vec * VEC) // group_k)[None, :]
        acc_g += tl.sum(g * x, axis=2) * tl.load(sg_ptrs + cols)
        acc_u += tl.sum(u * x, axis=2) * tl.load(su_ptrs + cols)
    if not EVEN_K:  # the partial last chunk
        kmask = (k_full + kk) < hidden_size
        vmask = ((k_full + vec * VEC) < hidden_size)[None, :]
        cols = ((k_full + vec * VEC) // group_k)[None, :]
        g = tl.load(g_ptrs + k_full, mask=kmask[None, :, :], other=0.0).to(tl.float32)
        u = tl.load(u_ptrs + k_full, mask=kmask[None, :, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptrs + k_full, mask=kmask, other=0.0).to(tl.float32)[None, :, :]
        acc_g += tl.sum(g * x, axis=2) * tl.load(sg_ptrs + cols, mask=vmask, other=0.0)
        acc_u += tl.sum(u * x, axis=2) * tl.load(su_ptrs + cols, mask=vmask, other=0.0)

    dtype = act_ptr.dtype.element_ty
    gate = tl.sum(acc_g, axis=1).to(dtype).to(tl.float32)  # F.linear's outputs, in the model dtype
    up = tl.sum(acc_u, axis=1).to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu in the model dtype
    tl.store(act_ptr + a.to(tl.int64) * stride_am + offs_i, (silu * up).to(dtype), mask=imask)


@triton.jit
def _down_acc(acc, w, s, a_ptrs, mask):
    # acc [BLOCK_E, BLOCK_N, BLOCK_K // VEC] += (sum over the thread-local VEC axis of w * act) * s, s the
    # vectors' scales. act [BLOCK_E, 1, BLOCK_K // VEC, VEC]: other ranks' rows are never read (unwritten).
    act = tl.load(a_ptrs, mask=mask, other=0.0)
    return acc + tl.sum(w.to(tl.float32) * act.to(tl.float32), axis=3) * s


@triton.jit
def _down_kernel(
    act_ptr, w2_ptr, s2_ptr, ids_ptr, weights_ptr, out_ptr,
    hidden_size, inter_size, expert_start, num_local, group_n, group_k,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    VEC: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    # grid: (num_tokens, cdiv(H, BLOCK_N)). out[t, n] = sum_j w_j * (act[t*k+j] . W2[e_j, n]), W2 = w2 times
    # its block scales.
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < hidden_size
    rows = tl.minimum(offs_n, hidden_size - 1).to(tl.int64)  # rows past H re-read row H-1
    slot = tl.arange(0, BLOCK_E)
    assign = token * TOP_K + slot
    # The routing is not written by stage 1 (see the module docstring): it may be read before the wait.
    expert = tl.load(ids_ptr + assign, mask=slot < TOP_K, other=-1).to(tl.int64) - expert_start
    valid = (slot < TOP_K) & (expert >= 0) & (expert < num_local)
    expert = tl.where(valid, expert, 0)
    weight = tl.load(weights_ptr + assign, mask=valid, other=0.0).to(tl.float32)

    vec = tl.arange(0, BLOCK_K // VEC)
    kk = vec[:, None] * VEC + tl.arange(0, VEC)[None, :]
    # [BLOCK_E, BLOCK_N, BLOCK_K // VEC, VEC]: every expert's rows n0.. of w2; act rows broadcast over n
    w_ptrs = (w2_ptr + expert[:, None, None, None] * stride_we + rows[None, :, None, None] * stride_wn
              + kk[None, None, :, :])
    a_ptrs = act_ptr + assign.to(tl.int64)[:, None, None, None] * stride_am + kk[None, None, :, :]
    # [BLOCK_E, BLOCK_N, 1]: the scale rows; a vector's column is its first k // group_k
    s_ptrs = s2_ptr + expert[:, None, None] * stride_se + (rows // group_n)[None, :, None] * stride_sn
    emask = valid[:, None, None, None]
    smask = valid[:, None, None]

    acc = tl.full([BLOCK_E, BLOCK_N, BLOCK_K // VEC], 0.0, tl.float32)
    k_full = (inter_size // BLOCK_K) * BLOCK_K
    k_start = 0
    if PREFETCH:  # at least one full chunk: with PDL, it streams in while stage 1 drains
        w_first = tl.load(w_ptrs, mask=emask, other=0.0)
        s_first = tl.load(s_ptrs + ((vec * VEC) // group_k)[None, None, :], mask=smask, other=0.0)
    pdl_wait(PDL)
    if PREFETCH:
        acc = _down_acc(acc, w_first, s_first, a_ptrs, emask)
        k_start = BLOCK_K
    for k0 in range(k_start, k_full, BLOCK_K):
        w = tl.load(w_ptrs + k0, mask=emask, other=0.0)
        s = tl.load(s_ptrs + ((k0 + vec * VEC) // group_k)[None, None, :], mask=smask, other=0.0)
        acc = _down_acc(acc, w, s, a_ptrs + k0, emask)
    if not EVEN_K:  # the partial last chunk
        mask = emask & ((k_full + kk) < inter_size)[None, None, :, :]
        vmask = smask & ((k_full + vec * VEC) < inter_size)[None, None, :]
        w = tl.load(w_ptrs + k_full, mask=mask, other=0.0)
        s = tl.load(s_ptrs + ((k_full + vec * VEC) // group_k)[None, None, :], mask=vmask, other=0.0)
        acc = _down_acc(acc, w, s, a_ptrs + k_full, mask)

    dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=2).to(dtype).to(tl.float32)  # [BLOCK_E, BLOCK_N]: F.linear's outputs
    y = (y * weight[:, None]).to(dtype).to(tl.float32)  # times the routing weight, in the model dtype
    y = tl.where(valid[:, None], y, 0.0)  # other ranks' experts (and padding slots): exactly zero
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, tl.sum(y, axis=0).to(dtype), mask=nmask)


def fp8_moe_gemv_config(hidden_size: int, inter_size: int, top_k: int) -> MoeGemvConfig:
    """The first bf16 rule, in bytes, for one-byte weights (not measured for fp8 yet; the bf16 sweep
    that replaced it in moe_gemv_config did not cover these kernels). Qwen3-30B-A3B (H 2048, I 768,
    top-8): stage 1 one gate/up row pair a program, all of H (2 KiB of each row) in one chunk,
    4 warps; stage 2 one output row a program, 8 experts x 256 of I per chunk (3 chunks), 4 warps."""
    block_k1 = chunk_width(hidden_size, 4096)
    warps1 = max(1, min(8, block_k1 // (min(16, block_k1) * 32)))
    block_e = triton.next_power_of_2(top_k)
    block_k2 = chunk_width(inter_size, max(16, 8192 // block_e))
    warps2 = max(1, min(4, block_e * block_k2 // (min(16, block_k2) * 32)))
    return MoeGemvConfig(block_i=1, block_k1=block_k1, warps1=warps1, block_n=1, block_k2=block_k2, warps2=warps2)


def fused_experts_fp8_small_batch_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                                         w13_scale: torch.Tensor, w2_scale: torch.Tensor, group_n13: int,
                                         group_n2: int, group_k: int, topk_weights: torch.Tensor,
                                         topk_ids: torch.Tensor, expert_start: int = 0, *,
                                         config: MoeGemvConfig | None = None) -> torch.Tensor:
    """`fused_experts_fp8_reference` with activation_group None: hidden [T, H] -> [T, H], always via
    Triton. Meant for T <= moe_gemv.MAX_TOKENS (correct for any T). `config` replaces
    `fp8_moe_gemv_config(...)` (benchmarks, tests); its block sizes must be powers of two."""
    assert hidden.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, "hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]"
    num_tokens, hidden_size = hidden.shape
    num_local, two_i, _ = w13.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    assert w13.shape == (num_local, 2 * inter_size, hidden_size), (tuple(w13.shape), hidden_size)
    assert w2.shape == (num_local, hidden_size, inter_size), (tuple(w2.shape), tuple(w13.shape))
    assert w13.dtype == w2.dtype == FP8_DTYPE, (w13.dtype, w2.dtype)
    assert w13_scale.shape == (num_local, triton.cdiv(two_i, group_n13), triton.cdiv(hidden_size, group_k)), \
        (tuple(w13_scale.shape), group_n13, group_k)
    assert w2_scale.shape == (num_local, triton.cdiv(hidden_size, group_n2), triton.cdiv(inter_size, group_k)), \
        (tuple(w2_scale.shape), group_n2, group_k)
    assert w13_scale.dtype == w2_scale.dtype == torch.float32, (w13_scale.dtype, w2_scale.dtype)
    assert topk_ids.shape == topk_weights.shape == (num_tokens, top_k), \
        (tuple(topk_ids.shape), tuple(topk_weights.shape))
    assert hidden.dtype in (torch.bfloat16, torch.float16, torch.float32), hidden.dtype
    assert all(t.stride(-1) == 1 for t in (w13, w2, w13_scale, w2_scale)), "weight and scale rows must be contiguous"
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0 or hidden_size == 0:
        return out
    if top_k == 0 or num_local == 0 or inter_size == 0:
        return out.zero_()
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()  # assignment a = token * k + j

    cfg = config or fp8_moe_gemv_config(hidden_size, inter_size, top_k)
    assert all(v > 0 and v & (v - 1) == 0 for v in (cfg.block_i, cfg.block_k1, cfg.block_n, cfg.block_k2)), cfg
    grid1 = (num_tokens * top_k, triton.cdiv(inter_size, cfg.block_i))
    grid2 = (num_tokens, triton.cdiv(hidden_size, cfg.block_n))
    assert grid1[1] < 65536 and grid2[1] < 65536, (grid1, grid2, "a grid's second axis is at most 65535")
    act = torch.empty((num_tokens * top_k, inter_size), dtype=hidden.dtype, device=hidden.device)
    pdl = pdl_args()
    _gate_up_kernel[grid1](
        hidden, w13, w13_scale, ids, act,
        hidden_size, inter_size, expert_start, num_local, group_n13, group_k,
        hidden.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_I=cfg.block_i, BLOCK_K=cfg.block_k1, VEC=_vec(cfg.block_k1, group_k),
        EVEN_K=hidden_size % cfg.block_k1 == 0, num_warps=cfg.warps1, **pdl,
    )
    _down_kernel[grid2](
        act, w2, w2_scale, ids, weights, out,
        hidden_size, inter_size, expert_start, num_local, group_n2, group_k,
        act.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_E=triton.next_power_of_2(top_k), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k2,
        VEC=_vec(cfg.block_k2, group_k), EVEN_K=inter_size % cfg.block_k2 == 0,
        PREFETCH=inter_size >= cfg.block_k2, num_warps=cfg.warps2, **pdl,
    )
    return out
