"""The FP8 linear the layers call: y = x W^T (+ bias) for a block-scaled float8_e4m3fn weight.

    fp8_linear(x [..., K], weight [N, K], weight_scale, group_n, group_k, bias, activation_group)
        -> [..., N] in x's dtype

Paths (`kernels/fp8_math.py` holds the weight contract and the reference):
  * not `use_triton(x)` (CPU tensors, `--forward reference`): `fp8_linear_reference`.
  * one row (batch-1 decode), or at most 4 without an activation_group: `fp8_gemv_triton`,
    W8A16: at one row reading the weight is the whole cost, and not quantizing x saves a
    launch. activation_group is ignored there, so these rows match
    `fp8_linear_reference(..., activation_group=None)`.
  * more rows with an activation_group: `quantize_activation` (per token and group) then the
    W8A8 `fp8_gemm_triton`, which matches the reference with that activation_group (from two
    rows on it beats the GEMV on an H200: benchmarks/fp8_skinny_probe.py).
  * more rows without one: the W8A16 `fp8_gemm_triton`.
Inputs the kernels cannot take (group sizes that are not multiples of 16 and below K, an x
dtype other than bf16/fp16/fp32, weight rows not contiguous, scales not float32) take the
reference, with a warning logged once per reason. Every path is CUDA-graph capturable: no
host syncs and no data-dependent shapes (the path depends on shapes and dtypes only).
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from metrale.kernels import use_triton
from metrale.kernels.fp8_gemm import fp8_gemm_triton, groups_supported
from metrale.kernels.fp8_gemv import MAX_M, fp8_gemv_triton
from metrale.kernels.fp8_quant import quantize_activation
from metrale.kernels import fp8_math

logger = logging.getLogger(__name__)

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)
def _warn_fallback(reason: str) -> None:
    logger.warning("fp8_linear: %s; using the PyTorch reference (slow) for these layers", reason)


def _unsupported(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_k: int,
                 activation_group: int | None) -> str | None:
    """Why the Triton kernels cannot take these inputs, or None when they can."""
    K = x.shape[-1]
    if not groups_supported(K, group_k, activation_group):
        return f"group_k {group_k} / activation_group {activation_group} not multiples of 16 (K={K})"
    if x.dtype not in _X_DTYPES:
        return f"x dtype {x.dtype}"
    if weight.dtype != fp8_math.FP8_DTYPE or weight.stride(-1) != 1:
        return f"weight {weight.dtype} with strides {weight.stride()}"
    if weight_scale.dtype != torch.float32 or weight_scale.stride(-1) != 1:
        return f"weight_scale {weight_scale.dtype} with strides {weight_scale.stride()}"
    return None


def rows_on_one_path(activation_group: int | None) -> int:
    """The fewest rows from which `fp8_linear` takes a GEMM rather than the GEMV, so the same path
    for every larger row count: a step padded to more rows (a prefill CUDA graph) computes its
    real rows as the unpadded step does (the GEMMs' configs are picked by power-of-two buckets of
    M, and each row's output depends on that row alone). Below it, the one-row GEMV (W8A16)
    stands in for the W8A8 GEMM, or the GEMV at up to MAX_M rows for the W8A16 GEMM."""
    return 2 if activation_group is not None else MAX_M + 1


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_n: int, group_k: int,
               bias: torch.Tensor | None = None, activation_group: int | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: y = x W^T (+ bias), W = weight * its group scales."""
    if not use_triton(x):
        return fp8_math.fp8_linear_reference(x, weight, weight_scale, group_n, group_k, bias, activation_group)
    reason = _unsupported(x, weight, weight_scale, group_k, activation_group)
    if reason is not None:
        _warn_fallback(reason)
        return fp8_math.fp8_linear_reference(x, weight, weight_scale, group_n, group_k, bias, activation_group)
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(math.prod(x.shape[:-1]), K)
    if x2.shape[0] < rows_on_one_path(activation_group):
        y = fp8_gemv_triton(x2, weight, weight_scale, group_n, group_k, bias)
    elif activation_group is not None:
        x_q, x_scale = quantize_activation(x2, activation_group)
        y = fp8_gemm_triton(x_q, x_scale, weight, weight_scale, group_n, group_k, activation_group, bias,
                            out_dtype=x.dtype)
    else:
        y = fp8_gemm_triton(x2, None, weight, weight_scale, group_n, group_k, None, bias)
    return y.view(*x.shape[:-1], N)
