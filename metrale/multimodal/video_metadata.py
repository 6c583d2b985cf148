"""vLLM's offline video form, `(frames, metadata)`, read as a DecodedVideo: the frames as given
and where they sit in the source, so a Qwen3-VL prompt's timestamps (and a Qwen2.5-VL video's
seconds per temporal patch) come from the source's fps rather than a default.

metadata keys: `fps` (of the source, required), `frames_indices` (each frame's index in the
source; default 0, 1, 2, ...), `total_num_frames` and `duration` (of the source; either gives
the duration, else it is the last index + 1 over fps), `video_backend` (ignored), and
`do_sample_frames` false only: frames are sampled by mm_processor_kwargs' fps / max_frames.
Any other key, or a bad value, is refused by name.
"""

from __future__ import annotations

import numpy as np

from metrale.messages.errors import InvalidRequestError
from metrale.multimodal.video_decode import DecodedVideo

METADATA_KEYS = ("fps", "frames_indices", "total_num_frames", "duration", "video_backend", "do_sample_frames")


def is_frames_with_metadata(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)


def _refuse(message: str):
    raise InvalidRequestError(f"video metadata: {message}", "multi_modal_data")


def _positive(metadata: dict, key: str) -> float | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        _refuse(f"{key} must be a positive number, got {value!r}")
    return float(value)


def decoded_from_metadata(frames, metadata: dict) -> DecodedVideo:
    unknown = sorted(set(metadata) - set(METADATA_KEYS))
    if unknown:
        _refuse(f"unknown key(s) {', '.join(map(repr, unknown))}; it takes {', '.join(METADATA_KEYS)}")
    if metadata.get("do_sample_frames"):
        _refuse("do_sample_frames true is not supported: the frames are taken as given; sample them with "
                "mm_processor_kwargs fps / max_frames")
    if not isinstance(frames, np.ndarray) or frames.ndim != 4:
        _refuse("the frames must be uint8 numpy [T, H, W, 3]")
    fps = _positive(metadata, "fps")
    if fps is None:
        _refuse("fps (of the source) is required")
    indices = metadata.get("frames_indices")
    indices = list(range(len(frames))) if indices is None else [int(i) for i in np.asarray(indices).ravel()]
    if len(indices) != len(frames) or any(i < 0 for i in indices) or indices != sorted(indices):
        _refuse(f"frames_indices must be one increasing index per frame ({len(frames)} frames)")
    total = _positive(metadata, "total_num_frames")
    duration = _positive(metadata, "duration") or (total / fps if total else (indices[-1] + 1) / fps if indices else 0.0)
    return DecodedVideo(frames, fps, indices, duration)
