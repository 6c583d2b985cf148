"""The FP8 indexer cache's arithmetic (cache kind "indexer" with --indexer-cache-dtype fp8), the
ground truth of any kernel that writes or reads that cache.

One scale per token: scale = amax(|k|) / 448 in float32 (a key of zeros gets scale 1, so it
stores zeros and divides by nothing), keys stored as float8_e4m3fn of k / scale, which rounds to
nearest even and never exceeds 448 in magnitude. A key reads back as e4m3 * scale.
"""

from __future__ import annotations

import torch

from metrale.kernels.fp8_math import FP8_DTYPE, FP8_MAX


def quantize_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [..., D] -> (float8_e4m3fn [..., D], float32 scales [...])."""
    k = keys.float()
    amax = k.abs().amax(dim=-1)
    # A tensor divisor: the correctly rounded amax / 448 (see kernels/fp8_math.quantize_weight).
    scale = amax / torch.full_like(amax, FP8_MAX)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    return (k / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_keys(keys: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse: float8 [..., D] and float32 [...] -> float32 [..., D]."""
    return keys.float() * scales.float()[..., None]
