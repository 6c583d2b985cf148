"""FP8 weight scales as met holds them: one row per weight row while loading, then one row per
block of rows wherever the whole layer allows it.

Loading a scale one row per weight row lets it travel through exactly the loader its weight
takes: merged projections, TP slices and interleaved heads move weight rows, and the scale rows
move with them. Once every piece is in, `compress_rows` keeps one scale row per `block` weight
rows if every such block of the loaded layout has a single scale (the common case: projections
and shards are multiples of 128 rows), and the per-row scales otherwise (a merged projection
whose segments are not block multiples, so that one block of rows would hold two of its
checkpoint's blocks).
"""

from __future__ import annotations

import torch

from metrale.kernels.fp8_math import cdiv


def expand_checkpoint_scale(scale: torch.Tensor, weight_shape: tuple[int, ...], block_n: int, block_k: int,
                            name: str) -> torch.Tensor:
    """A checkpoint's block scale [ceil(N/bn), ceil(K/bk)] of a weight [N, K] -> one row per
    weight row [N, ceil(K/bk)], float32."""
    rows, cols = weight_shape[-2], weight_shape[-1]
    expected = (cdiv(rows, block_n), cdiv(cols, block_k))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name}: scale shape {tuple(scale.shape)} does not match the {list(weight_shape)} weight's "
                         f"[{block_n}, {block_k}] blocks {expected}")
    return scale.float().repeat_interleave(block_n, dim=0)[:rows]


def compress_rows(scale: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """Per-row scales [..., N, C] -> (scales, rows per scale row): [..., ceil(N/block), C] and
    `block` when every block of rows shares its scales, else the input and 1."""
    rows = scale.shape[-2]
    if block <= 1 or rows == 0:
        return scale, 1
    blocks = cdiv(rows, block)
    padded = torch.cat([scale, scale[..., -1:, :].expand(*scale.shape[:-2], blocks * block - rows, scale.shape[-1])],
                       dim=-2) if blocks * block != rows else scale
    grouped = padded.reshape(*scale.shape[:-2], blocks, block, scale.shape[-1])
    if not bool((grouped == grouped[..., :1, :]).all()):
        return scale, 1
    return grouped[..., 0, :].contiguous(), block
