"""Bidirectional attention of a vision tower over packed items: tokens of several images, frames
or windows back to back, each segment of `cu_seqlens` attending only within itself.

This is the PyTorch reference path: scaled_dot_product_attention per segment (as transformers'
SDPA path does it), segments of equal length batched into one call. It runs on CPU and GPU; a
varlen kernel (one launch for ragged segments) is not written yet. The projections are replicated on every tensor-parallel rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.layers.linear import ReplicatedLinear


def rotate_vision(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation over the whole head in float32, cast back (transformers' vision rotary).
    x [tokens, heads, head_dim]; cos, sin [tokens, head_dim]."""
    dtype, x = x.dtype, x.float()
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                      scale: float) -> torch.Tensor:
    """q, k, v [tokens, heads, head_dim] -> [tokens, heads, head_dim], within each segment.
    Segments of one length (an image's full windows, a video's frames) run as one batched call."""
    out = torch.empty_like(q)
    by_length: dict[int, list[int]] = {}
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    for length, starts in by_length.items():
        rows = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).flatten()
        # [segments, heads, length, head_dim]
        part = [x[rows].view(len(starts), length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)]
        out[rows] = F.scaled_dot_product_attention(*part, scale=scale).transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = ReplicatedLinear(dim, 3 * dim, bias=True, quantizable=False)
        self.proj = ReplicatedLinear(dim, dim, bias=True, quantizable=False)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate_vision(q, cos, sin), rotate_vision(k, cos, sin)
        out = segment_attention(q, k, v, cu_seqlens, self.head_dim ** -0.5)
        return self.proj(out.reshape(x.shape[0], -1))
