"""RMSNorm, with the residual add fused in when a residual is given.

Numerics follow Hugging Face's LlamaRMSNorm exactly: normalise in float32, cast back to the
input dtype, then scale by the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.kernels import use_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if use_triton(x):
            from metrale.kernels.rms_norm import fused_add_rms_norm_triton, rms_norm_triton

            if residual is None:
                return rms_norm_triton(x, self.weight, self.eps)
            return fused_add_rms_norm_triton(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored zero-centred (scale = 1 + weight), as Qwen3-Next, Qwen3.5
    and Gemma keep it, with their rounding: normalise and scale in float32, cast once."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if use_triton(x):
            from metrale.kernels.rms_norm import fused_add_rms_norm_triton, rms_norm_triton

            if residual is None:
                return rms_norm_triton(x, self.weight, self.eps, zero_centred=True)
            return fused_add_rms_norm_triton(x, residual, self.weight, self.eps, zero_centred=True)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head of x, scaled by the weight, then gated by silu(gate): the output norm
    of Gated DeltaNet layers (norm before gate, as Qwen3-Next's reference)."""

    def __init__(self, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [tokens, heads * head_dim] -> the same shape."""
        if use_triton(x):
            from metrale.kernels.rms_norm import gated_rms_norm_triton

            return gated_rms_norm_triton(x, gate, self.weight, self.eps)
        dim = self.weight.shape[0]
        h = x.reshape(-1, dim).float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(gate.reshape(-1, dim).float())).to(x.dtype).view(x.shape)
