"""Per-token-group FP8 (e4m3) quantization of activations, the first half of a W8A8 linear.

    x [M, K] -> q float8_e4m3fn [M, K], scale float32 [M, ceil(K / group)]
    x[m, k] ~= q[m, k] * scale[m, k // group],  scale = max(amax(|group|) / 448, MIN_SCALE)

Contract (`kernels/fp8_math.py`'s `quantize_activation` is the ground truth):
  * x bf16/fp16/fp32 with a contiguous last dim; rows may be strided. q and scale are new,
    contiguous tensors. A group of at least K features is one group per row.
  * Bitwise equal to the reference: the group's amax is exact, and both divisions (amax / 448,
    x / scale) are correctly rounded (`div_rn`: Triton's `/` is an approximate division on
    NVIDIA GPUs), then x / scale is clamped to +-448 and rounded to nearest-even onto e4m3,
    as torch's cast does.
  * Neither of Triton's float32 -> fp8 casts rounds once to nearest-even: on an H200 (triton
    3.6) it goes through float16 first, a double rounding (61.9999962 -> 62.0 -> 64, where
    torch gives 60; 213 of 1M values differed), and the CPU interpreter's (triton 3.9) rounds
    ties away from zero and drops the carry into the exponent (125.6 becomes 64, not 128). So
    the value is first rounded onto e4m3's grid in float32 arithmetic (`round_to_e4m3`), after
    which either cast is exact.

Design: program (row, j) quantizes BLOCK_GROUPS consecutive groups of one row, loaded as a
[BLOCK_GROUPS, BLOCK_G] tile (BLOCK_G = group rounded up to a power of two, the extra columns
masked), so every group's amax is a reduction along the tile's second axis. The tile holds
about 2048 elements (`quant_config`), a pure function of (K, group).
"""

from __future__ import annotations

import torch

from metrale.kernels import pdl_args, pdl_wait, tl, triton, use_triton
from metrale.kernels import fp8_math

_TILE_ELEMENTS = 2048
_NUM_WARPS = 4


@triton.jit
def round_to_e4m3(v):
    # v (float32, |v| <= 448) rounded to nearest-even onto e4m3's grid, in float32: the grid step
    # (ulp) at v's binade is 2^(e - 3) for normals (e = floor(log2|v|) >= -6) and 2^-9 below
    # (subnormals); adding and subtracting 1.5 * 2^23 * ulp rounds |v| to a multiple of ulp
    # with the float32 adder's own round-to-nearest-even. The sign is put back bitwise (-0 too).
    bits = v.to(tl.uint32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF).to(tl.int32) - 127, -6)
    ulp = ((exponent + (127 - 3)) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0  # 1.5 * 2^23
    rounded = ((tl.abs(v) + magic) - magic).to(tl.uint32, bitcast=True)
    return (rounded | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, scale_ptr,
    K, group_size, num_groups, stride_xm, stride_qm, stride_sm,
    BLOCK_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr,
):
    # grid: (M, cdiv(num_groups, BLOCK_GROUPS)).
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    cols = tl.arange(0, BLOCK_G)
    k = groups[:, None] * group_size + cols[None, :]
    mask = (cols[None, :] < group_size) & (k < K)
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_xm + k, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1e-10)  # MIN_SCALE
    v = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0)
    v = round_to_e4m3(v)
    tl.store(q_ptr + row * stride_qm + k, v.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_sm + groups, scale, mask=groups < num_groups)


def quant_config(K: int, group: int) -> tuple[int, int]:
    """-> (BLOCK_GROUPS, BLOCK_G): groups per program and the padded group width, both powers of
    two, about 2048 elements a program (fewer when the row has fewer groups)."""
    block_g = triton.next_power_of_2(group)
    num_groups = triton.cdiv(K, group)
    block_groups = max(1, min(_TILE_ELEMENTS // block_g, triton.next_power_of_2(num_groups)))
    return block_groups, block_g


def quantize_activation_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 [M, ceil(K / group)]), always via Triton."""
    assert x.dim() == 2 and x.stride(1) == 1, "x [M, K] with a contiguous last dim"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    assert group >= 1, group
    M, K = x.shape
    group = min(group, K) if K else group
    num_groups = triton.cdiv(K, group)
    q = torch.empty((M, K), dtype=fp8_math.FP8_DTYPE, device=x.device)
    scale = torch.empty((M, num_groups), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, scale
    block_groups, block_g = quant_config(K, group)
    _quantize_kernel[(M, triton.cdiv(num_groups, block_groups))](
        x, q, scale, K, group, num_groups, x.stride(0), q.stride(0), scale.stride(0),
        BLOCK_GROUPS=block_groups, BLOCK_G=block_g, num_warps=_NUM_WARPS,
        **pdl_args())
    return q, scale


def quantize_activation(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q, scale) as `fp8_math.quantize_activation`: Triton for CUDA tensors (last dim
    contiguous), the PyTorch reference otherwise."""
    if use_triton(x) and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return quantize_activation_triton(x, group)
    return fp8_math.quantize_activation(x, group)
