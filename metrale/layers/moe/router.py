"""A router kept in float32 whatever the model dtype: DeepSeek-V3's gate, which its reference
keeps in float32 (transformers' `_keep_in_fp32_modules_strict`) and applies to the hidden states
cast to float32, so the experts a token picks do not depend on the model dtype's rounding.

Replicated on every rank (routing runs over all experts, layer.py); never quantized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Float32Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> router logits [T, num_experts] in float32."""
        return F.linear(hidden.float(), self.weight)
