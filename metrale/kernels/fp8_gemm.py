"""Block-scaled FP8 GEMM: y = x @ W^T (+ bias) with W stored as float8_e4m3fn and group scales.

Weights follow `kernels/fp8_math.py`: weight float8_e4m3fn [N, K] with float32 scales
[ceil(N / group_n), ceil(K / group_k)], W[n, k] = weight[n, k] * weight_scale[n // group_n,
k // group_k]. One kernel, two variants (the W8A8 constexpr):

  W8A8   x arrives quantized (`fp8_quant.quantize_activation`): x_q float8_e4m3fn [M, K] with
         x_scale float32 [M, ceil(K / activation_group)]. Each K tile is an fp8 x fp8 `tl.dot`
         with float32 accumulation, multiplied by x_scale[m, k0 // activation_group] *
         weight_scale[n // group_n, k0 // group_k] and added to the float32 accumulator: each
         tile's dot starts from zero, so Hopper's fp8 MMA, which accumulates in a format
         narrower than fp32 (Triton's sm_90 default never promotes inside a dot), sums at most
         BLOCK_K products before they reach fp32 (DeepSeek-V3's promotion interval, 128).
  W8A16  x stays in its dtype (bf16/fp16/fp32, `activation_group=None`): each weight tile is
         dequantized in registers (fp8 -> float32 * its scale -> x's dtype, one rounding of W
         for 16-bit x) and accumulated by a 16-bit (fp32: IEEE) `tl.dot` in float32.

How the weight scale is applied, picked by the launcher from the groups (the same formula):
  WS_CHANNEL  group_k >= K (one scale column: per-output-channel, `--quantization fp8`): the
              scales are constant over K and multiply the accumulator once, after the K loop;
              W8A16 then feeds the dot the fp8 tile converted exactly to x's dtype (no rounding).
  WS_TILE     BLOCK_N divides group_n or group_n >= N ([128, 128] blocks): the tile lies in one
              scale row, so each K tile has one scalar weight scale.
  otherwise   (group_n = 1 with group_k < K, or an odd group_n): a scale per column and K tile,
              which costs registers (a thread holds the scales of all its accumulator columns).

Contract:
  * x rows may be strided (last dim contiguous); weight rows contiguous; scales contiguous
    in their last dim. y [M, N] is new, of `out_dtype`, rounded once from float32 after the
    bias add. group_n is any positive size (loaded per output column: 1 and 128 alike).
  * BLOCK_K divides group_k and activation_group, except a group >= K, which has one scale
    column (per-output-channel weights); the launcher shrinks BLOCK_K to the largest power of
    two dividing both, so the groups must be multiples of 16 (fp8_linear falls back otherwise).
  * Partial edge tiles: rows of x and weight past M / N re-read valid rows (loads stay
    unmasked along M, N) and are dropped at the store; the last K tile is masked to zeros.
  * Deterministic: no split-K, no atomics, the config a pure function of (M, N, K, variant)
    (`fp8_gemm_config`), so results are bitwise reproducible. Compared with
    `fp8_linear_reference`, only the float32 summation order differs (and W8A16's rounding of
    the dequantized tile to x's dtype, outside WS_CHANNEL).
  * Under the CPU interpreter (triton 3.9) fp8 `tl.dot` works (operands are widened to fp16,
    exactly), but bf16 `tl.dot` multiplies raw uint16 storage: there (UPCAST) W8A16 with bf16
    x computes the same products as float32 dots. The GPU path uses the real fp8 / bf16 dots.

Programs are ordered with the usual GROUP_M swizzle (GROUP_M row tiles sweep the N tiles
together) so a weight tile is reused from L2 by several row tiles. Programmatic dependent
launch: every program waits (pdl_wait) before its first load, as x comes from the previous
kernel; nothing is prefetched, since a GEMM's prologue is short next to its K loop.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from metrale.kernels import interpret_mode, pdl_args, pdl_wait, tl, triton
from metrale.kernels import fp8_math

# An H100/H200 SXM; the constant (rather than the device's count) keeps the config a function
# of the shapes alone.
_NUM_SMS = 132
_MIN_BLOCK_N = 32


class Fp8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# Upper M of each bucket -> (block_m, block_n, block_k, group_m, num_warps, num_stages).
# The M <= 16 W8A8 row is the best of benchmarks/fp8_skinny_probe.py on an H200 at Qwen3-8B's
# shapes at 4 and 16 rows (qkv 15.6 / 14.9 us, gate_up 35.2 / 28.5 us; 64-wide tiles took
# 16.2 at 16 rows); the other rows are initial values (benchmarks/fp8_gemm_bench.py times
# them and candidates around them). BLOCK_K 128 is one [128, 128] weight
# block's depth in fp8; W8A16 halves it where x's 16-bit tile is large (M > 16), so a stage's
# shared memory stays alike. Shared memory per stage: block_k * (block_m * x bytes + block_n).
_W8A8_TABLE = (
    (16, Fp8GemmConfig(16, 32, 128, 1, 2, 4)),     # weight-bound: thin tiles, many programs
    (64, Fp8GemmConfig(64, 64, 128, 1, 4, 4)),     # one wgmma row tile (64 rows per warpgroup)
    (256, Fp8GemmConfig(64, 128, 128, 8, 4, 4)),
    (None, Fp8GemmConfig(128, 128, 128, 8, 8, 4)),  # compute-bound: 2 warpgroups, 128 KiB ring
)
_W8A16_TABLE = (
    (16, Fp8GemmConfig(16, 64, 128, 1, 4, 4)),
    (64, Fp8GemmConfig(64, 64, 64, 1, 4, 4)),
    (256, Fp8GemmConfig(64, 128, 64, 8, 4, 4)),
    (None, Fp8GemmConfig(128, 128, 64, 8, 8, 3)),
)


def fp8_gemm_config(M: int, N: int, K: int, w8a8: bool = True) -> Fp8GemmConfig:
    """Default launch config: the row of the table above for M's bucket, then
      * BLOCK_N halved (down to 32) while the grid has fewer programs than the 132 SMs, so
        small-M shapes (weight-bandwidth bound, no split-K) still spread over the device;
      * every block capped at its dimension rounded up to a power of two (at least 16, what
        tl.dot takes), which only matters for tiny shapes (tests).
    BLOCK_K may shrink further at launch to divide the quantization groups (see module doc)."""
    table = _W8A8_TABLE if w8a8 else _W8A16_TABLE
    cfg = next(c for upper, c in table if upper is None or M <= upper)
    block_m, block_n, block_k = cfg.block_m, cfg.block_n, cfg.block_k
    while block_n > _MIN_BLOCK_N and triton.cdiv(M, block_m) * triton.cdiv(N, block_n) < _NUM_SMS:
        block_n //= 2
    return cfg._replace(block_m=min(block_m, _pow2_at_least_16(M)), block_n=min(block_n, _pow2_at_least_16(N)),
                        block_k=min(block_k, _pow2_at_least_16(K)))


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def block_k_for_groups(block_k: int, K: int, *groups: int | None) -> int:
    """The largest power of two <= block_k that divides every group below K (None: no group)."""
    for g in groups:
        if g is not None and g < K:
            block_k = min(block_k, g & -g)  # g's largest power-of-two divisor
    return block_k


def groups_supported(K: int, *groups: int | None) -> bool:
    """Whether the kernels take these group sizes: multiples of 16, or at least K."""
    return all(g is None or g >= K or (g > 0 and g % 16 == 0) for g in groups)


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Program id -> (row tile, column tile): GROUP_M row tiles walk the column tiles together.
    # Builtins only (no tl.cdiv): see triton_moe.py.
    pid = tl.program_id(0)
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr):
    # acc + a @ b in float32. UPCAST (interpreter, bf16 only): the same products as fp32 dots.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if IEEE_FP32:  # float32 x gets float32 products, not TF32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _w_scale(ws_ptrs, k0, group_k, WS_TILE: tl.constexpr):
    # The weight scales of the K tile at k0, shaped to broadcast over [*, BLOCK_N]: one scalar
    # (WS_TILE: the tile lies in one group of rows) or one per column ([1, BLOCK_N]).
    s = tl.load(ws_ptrs + k0 // group_k)
    if not WS_TILE:
        s = s[None, :]
    return s


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
    M, N, K, group_n, group_k, act_group,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ym,
    W8A8: tl.constexpr, WS_TILE: tl.constexpr, WS_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),); program owns y[offs_m, offs_n].
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = (offs_m % M).to(tl.int64)  # past the edge: valid rows, dropped at the store
    rows_n = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N], K-major
    if WS_TILE:  # the tile's scale row
        ws_ptrs = ws_ptr + ((pid_n * BLOCK_N) // group_n) * stride_wsn
    else:  # the scale row of each output column
        ws_ptrs = ws_ptr + (rows_n // group_n) * stride_wsn
    xs_ptrs = xs_ptr + rows_m * stride_xsm
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    pdl_wait(PDL)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
        if W8A8:
            x_scale = tl.load(xs_ptrs + k0 // act_group)[:, None]
            if WS_CHANNEL:
                acc += tl.dot(a, b) * x_scale
            else:
                acc += tl.dot(a, b) * (x_scale * _w_scale(ws_ptrs, k0, group_k, WS_TILE))
        else:
            if WS_CHANNEL:  # fp8 -> 16-bit is exact: the scale waits for the end
                b = b.to(a.dtype)
            else:
                b = (b.to(tl.float32) * _w_scale(ws_ptrs, k0, group_k, WS_TILE)).to(a.dtype)
            acc = _dot(a, b, acc, UPCAST, IEEE_FP32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if WS_CHANNEL:  # (never WS_TILE too) one scale per column, for all of K
        acc *= tl.load(ws_ptrs)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def fp8_gemm_triton(x_q: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor,
                    weight_scale: torch.Tensor, group_n: int, group_k: int, activation_group: int | None,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
                    config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """y [M, N] = x W^T (+ bias), always via Triton.

    W8A8 when x_q is float8_e4m3fn (x_scale [M, ceil(K / activation_group)] float32 required);
    W8A16 when x_q is bf16/fp16/fp32 (x_scale and activation_group None). out_dtype defaults to
    x's dtype (W8A16) or bfloat16 (W8A8). `config` replaces `fp8_gemm_config(M, N, K, w8a8)`
    (for benchmarks); its block_k still shrinks to fit the groups."""
    assert x_q.dim() == 2 and weight.dim() == 2, "x [M, K], weight [N, K]"
    M, K = x_q.shape
    N = weight.shape[0]
    w8a8 = x_q.dtype == fp8_math.FP8_DTYPE
    assert weight.shape[1] == K and weight.dtype == fp8_math.FP8_DTYPE, (tuple(weight.shape), weight.dtype)
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    assert weight_scale.dtype == torch.float32 and weight_scale.stride(1) == 1, weight_scale.dtype
    assert weight_scale.shape == (triton.cdiv(N, group_n), triton.cdiv(K, min(group_k, max(K, 1)))), \
        (tuple(weight_scale.shape), group_n, group_k)
    if w8a8:
        assert activation_group is not None and x_scale is not None and x_scale.dtype == torch.float32
        assert x_scale.shape == (M, triton.cdiv(K, min(activation_group, max(K, 1)))) and x_scale.stride(1) == 1
    else:
        assert x_scale is None and activation_group is None, "W8A16 takes x unquantized"
        assert x_q.dtype in (torch.bfloat16, torch.float16, torch.float32), x_q.dtype
    assert groups_supported(K, group_k, activation_group), (group_k, activation_group)
    if x_q.stride(1) != 1:
        x_q = x_q.contiguous()
    out_dtype = out_dtype or (torch.bfloat16 if w8a8 else x_q.dtype)
    if bias is not None:
        assert bias.shape == (N,), bias.shape
        bias = bias.contiguous()
    y = torch.empty((M, N), dtype=out_dtype, device=x_q.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(M, N))

    cfg = config or fp8_gemm_config(M, N, K, w8a8)
    block_k = block_k_for_groups(cfg.block_k, K, group_k, activation_group)
    assert block_k >= 16 and all(b & (b - 1) == 0 for b in (cfg.block_m, cfg.block_n, block_k)), cfg
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    ws_channel = group_k >= K
    _fp8_gemm_kernel[grid](
        x_q, x_scale if w8a8 else y, weight, weight_scale, bias if bias is not None else y, y,
        M, N, K, group_n, group_k, activation_group or 1,
        x_q.stride(0), x_scale.stride(0) if w8a8 else 0, weight.stride(0), weight_scale.stride(0), y.stride(0),
        W8A8=w8a8, WS_CHANNEL=ws_channel, WS_TILE=not ws_channel and (group_n % cfg.block_n == 0 or group_n >= N),
        HAS_BIAS=bias is not None, UPCAST=interpret_mode() and x_q.dtype == torch.bfloat16,
        IEEE_FP32=x_q.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(),
    )
    return y
