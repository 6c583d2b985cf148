"""Index arithmetic of the Qwen-VL vision towers, from `grid_thw` alone (no weights).

Patches arrive from the processor in spatial-merge-block order: for each frame, the merge_size x
merge_size blocks row by row, and inside a block its patches row by row. Every index here is in
that order. grid_thw [n_items, 3] = (t, h, w) in patches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _items(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in row) for row in grid_thw.tolist()]


def patch_positions(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """[patches, 2] int64: each patch's (row, column) in its frame, the 2D rotary's positions."""
    out = []
    for t, h, w in _items(grid_thw):
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge_size, merge_size, w // merge_size, merge_size)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))
    return torch.cat(out)


def frame_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """[segments + 1] int64: one attention segment per frame of every item (h * w patches)."""
    lengths = [h * w for t, h, w in _items(grid_thw) for _ in range(t)]
    return F.pad(torch.tensor(lengths, dtype=torch.int64).cumsum(0), (1, 0))


def window_partition(grid_thw: torch.Tensor, merge_size: int, window_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL's window attention: windows of `window_patches` x `window_patches` merged units
    (the last row/column of windows partial), per frame. Returns (window_index [merged units]: the
    merged units in window order, each an index into the merge-block order; cu_window_seqlens
    [windows + 1] in patches). The permutation is undone after the merger by argsort."""
    order, lengths, base = [], [], 0
    unit = merge_size * merge_size
    for t, h, w in _items(grid_thw):
        mh, mw = h // merge_size, w // merge_size
        index = torch.arange(t * mh * mw).reshape(t, mh, mw)
        pad_h, pad_w = -mh % window_patches, -mw % window_patches
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (mh + pad_h) // window_patches, (mw + pad_w) // window_patches
        windows = padded.reshape(t, nh, window_patches, nw, window_patches).permute(0, 1, 3, 2, 4)
        windows = windows.reshape(t * nh * nw, window_patches * window_patches)
        for window in windows:
            kept = window[window >= 0]
            if kept.numel():
                order.append(kept + base)
                lengths.append(kept.numel() * unit)
        base += t * mh * mw
    cu = F.pad(torch.tensor(lengths, dtype=torch.int64).cumsum(0), (1, 0))
    return torch.cat(order), cu


def interpolated_table_index(grid_thw: torch.Tensor, side: int, merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-VL's learned position table (side x side) resampled bilinearly (align_corners) to each
    frame's h x w grid: (indices [patches, 4] into the flattened table, weights [patches, 4]), taps
    (r0, c0), (r0, c1), (r1, c0), (r1, c1), patches in merge-block order, repeated per frame."""
    all_index, all_weight = [], []
    for t, h, w in _items(grid_thw):
        r_taps, r_weights = _axis_taps(h, side)
        c_taps, c_weights = _axis_taps(w, side)
        index = (r_taps[:, None, :, None] * side + c_taps[None, :, None, :]).reshape(h, w, 4)
        weight = (r_weights[:, None, :, None] * c_weights[None, :, None, :]).reshape(h, w, 4)
        shape = (h // merge_size, merge_size, w // merge_size, merge_size, 4)
        index = index.reshape(shape).permute(0, 2, 1, 3, 4).reshape(-1, 4)
        weight = weight.reshape(shape).permute(0, 2, 1, 3, 4).reshape(-1, 4)
        all_index.append(index.repeat(t, 1))
        all_weight.append(weight.repeat(t, 1))
    return torch.cat(all_index), torch.cat(all_weight)


def _axis_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps per target position on an axis of `size`, and their linear-hat weights."""
    source = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(source)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights
