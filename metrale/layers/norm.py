"""RMSNorm, with the residual add fused in when a residual is given.

Numerics follow Hugging Face's LlamaRMSNorm exactly: normalise in float32, cast back to the
input dtype, then scale by the weight.
"""

from __future__ import annotations

import torch
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
