"""M-RoPE positions of one Qwen-VL prompt (numpy, no torch), as transformers' get_rope_index.

The prompt is runs of text and runs of placeholder tokens (image_token_id, video_token_id). A text
run continues one counter in all three rows. A vision run of a t x h x w grid (h, w after the
spatial merge) takes rows (start + time index, start + row, start + column) and moves the
counter on by max(h, w). Qwen2.5-VL spaces a video's time index by tokens_per_second *
second_per_grid_ts (float32, truncated, as transformers computes it); Qwen3-VL splits a video into
one run per frame (the processor puts timestamp text between frames), each a grid of t = 1.
At decode, token index i >= L sits at i + delta in every row, delta = max position + 1 - L.
"""

from __future__ import annotations

import numpy as np


def placeholder_runs(input_ids: list[int], image_token_id: int, video_token_id: int) -> list[tuple[str, int, int]]:
    """[(kind "text" | "image" | "video", start, end)] covering the prompt in order."""
    ids = np.asarray(input_ids, dtype=np.int64)
    kinds = np.where(ids == image_token_id, 1, np.where(ids == video_token_id, 2, 0))
    if len(ids) == 0:
        return []
    edges = np.flatnonzero(np.diff(kinds)) + 1
    starts, ends = np.concatenate(([0], edges)), np.concatenate((edges, [len(ids)]))
    names = ("text", "image", "video")
    return [(names[kinds[s]], int(s), int(e)) for s, e in zip(starts, ends)]


def _grids(grid_thw, what: str) -> list[tuple[int, int, int]]:
    if grid_thw is None:
        return []
    grids = np.asarray(grid_thw.tolist() if hasattr(grid_thw, "tolist") else grid_thw, dtype=np.int64)
    if grids.size == 0:
        return []
    if grids.ndim != 2 or grids.shape[1] != 3:
        raise ValueError(f"{what} must be [items, 3] (t, h, w), not {list(grids.shape)}")
    return [tuple(int(v) for v in row) for row in grids]


def mrope_positions(input_ids: list[int], image_token_id: int, video_token_id: int, merge_size: int,
                    image_grid_thw=None, video_grid_thw=None, video_time_intervals: list | None = None,
                    frames_as_items: bool = False) -> tuple[np.ndarray, int]:
    """(positions int64 [3, L], delta). `video_time_intervals`: each video's temporal step (float32)
    or None for 1. `frames_as_items`: each video frame is its own run (Qwen3-VL)."""
    grids = {"image": _grids(image_grid_thw, "image_grid_thw"), "video": _grids(video_grid_thw, "video_grid_thw")}
    intervals = {"image": [None] * len(grids["image"]), "video": list(video_time_intervals or [None] * len(grids["video"]))}
    if len(intervals["video"]) != len(grids["video"]):
        raise ValueError(f"{len(intervals['video'])} video time interval(s) for {len(grids['video'])} video(s)")
    if frames_as_items:
        grids["video"] = [(1, h, w) for t, h, w in grids["video"] for _ in range(t)]
        intervals["video"] = [None] * len(grids["video"])
    used = {"image": 0, "video": 0}
    pieces, current = [], 0
    for kind, start, end in placeholder_runs(input_ids, image_token_id, video_token_id):
        if kind == "text":
            pieces.append(np.broadcast_to(np.arange(current, current + end - start, dtype=np.int64), (3, end - start)))
            current += end - start
            continue
        if used[kind] >= len(grids[kind]):
            raise ValueError(f"the prompt has more {kind} placeholder runs than {kind} grids ({len(grids[kind])})")
        t, h, w = grids[kind][used[kind]]
        interval = intervals[kind][used[kind]]
        used[kind] += 1
        gh, gw = h // merge_size, w // merge_size
        if end - start != t * gh * gw:
            raise ValueError(f"a {kind} placeholder run of {end - start} token(s) does not match its grid "
                             f"{(t, h, w)} ({t * gh * gw} tokens after the {merge_size}x{merge_size} merge)")
        if interval is None:
            times = np.arange(t, dtype=np.int64)
        else:
            times = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
        tt, hh, ww = np.meshgrid(times, np.arange(gh), np.arange(gw), indexing="ij")
        pieces.append(np.stack((tt.ravel(), hh.ravel(), ww.ravel())).astype(np.int64) + current)
        current += max(gh, gw)
    for kind in ("image", "video"):
        if used[kind] != len(grids[kind]):
            raise ValueError(f"{len(grids[kind])} {kind} grid(s) for {used[kind]} {kind} placeholder run(s) in the prompt")
    if not pieces:
        return np.zeros((3, 0), dtype=np.int64), 0
    positions = np.ascontiguousarray(np.concatenate(pieces, axis=1))
    return positions, int(positions.max()) + 1 - positions.shape[1]
