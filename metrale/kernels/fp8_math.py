"""FP8 (e4m3) quantization arithmetic in plain PyTorch: the ground truth of every FP8 kernel.

A quantized weight W [N, K] is stored as
    weight        float8_e4m3fn [N, K]
    weight_scale  float32 [ceil(N / group_n), ceil(K / group_k)]
with W[n, k] ~= weight[n, k] * weight_scale[n // group_n, k // group_k]. Checkpoints in the
fine-grained format (DeepSeek-V3, Qwen3-*-FP8) name the scale `weight_scale_inv` and use
group_n = group_k = 128 ([128, 128] blocks, partial at the edges). met keeps that layout where
it can, and one scale row per weight row (group_n = 1) where a merged projection's segments or
an edge block would otherwise share a block (see quantization/fp8_layout.py). Online
quantization (`--quantization fp8`) is group_n = 1 with one scale per row (group_k >= K);
its activations are still quantized in groups of 128.

Activations are quantized on the fly per token and per group of `group_k` consecutive input
features ("dynamic per-token-group"):
    x [M, K] -> x_q float8_e4m3fn [M, K], x_scale float32 [M, ceil(K / group_k)]
with x[m, k] ~= x_q[m, k] * x_scale[m, k // group_k] and x_scale = amax(|group|) / 448.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# The smallest scale a group gets: an all-zero group quantizes to zeros instead of dividing by 0.
MIN_SCALE = 1e-10


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expand_scale(scale: torch.Tensor, rows: int, cols: int, group_n: int, group_k: int) -> torch.Tensor:
    """[ceil(rows / group_n), ceil(cols / group_k)] -> [rows, cols], each scale over its group."""
    return scale.repeat_interleave(group_n, dim=0)[:rows].repeat_interleave(group_k, dim=1)[:, :cols]


def quantize_weight(weight: torch.Tensor, group_n: int, group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (float8_e4m3fn [N, K], float32 scale [ceil(N/gn), ceil(K/gk)]):
    each group's scale is its amax / 448, so its largest value maps to the top of e4m3's range."""
    n, k = weight.shape
    gn, gk = min(group_n, n), min(group_k, k)
    rows, cols = cdiv(n, gn), cdiv(k, gk)
    padded = torch.zeros(rows * gn, cols * gk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, gn, cols, gk)
    amax = blocks.abs().amax(dim=(1, 3))
    # A tensor divisor: torch multiplies by the reciprocal of a Python scalar on CUDA, which is
    # not the correctly rounded amax / 448 the kernels compute.
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)
    quantized = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(rows * gn, cols * gk)[:n, :k].contiguous(), scale


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize_weight: float8 [N, K] * its group scales -> [N, K] in `dtype`."""
    n, k = weight.shape
    return (weight.float() * expand_scale(scale.float(), n, k, group_n, group_k)).to(dtype)


def quantize_activation(x: torch.Tensor, group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scale [M, ceil(K / group_k)]), per token and group."""
    q, scale = quantize_weight(x, 1, group_k)
    return q, scale


def fake_quantize_activation(x: torch.Tensor, group_k: int) -> torch.Tensor:
    """x as the FP8 kernels see it after quantizing it: quantized, then dequantized (float32)."""
    flat = x.reshape(-1, x.shape[-1])
    q, scale = quantize_activation(flat, group_k)
    return dequantize_weight(q, scale, 1, group_k).view(x.shape)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int,
                         bias: torch.Tensor | None = None, activation_group: int | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with W dequantized: the CPU path and what the kernels are tested
    against. With an activation_group, x first goes through per-token-group quantization over
    groups of that many features, as the W8A8 kernels do; None keeps x as it is (W8A16).
    Computed in float32, returned in x's dtype."""
    w = dequantize_weight(weight, scale, group_n, group_k)
    xf = x.float() if activation_group is None else fake_quantize_activation(x, activation_group)
    y = torch.nn.functional.linear(xf, w, None if bias is None else bias.float())
    return y.to(x.dtype)
