"""decode_video(data, policy): bytes -> DecodedVideo, or a MediaError.

In-process through PyAV (FFmpeg's libraries; no subprocess, no shell). Only the containers
below are opened, chosen from the file's own signature and named to FFmpeg explicitly, so no
format probing happens: probing would accept playlist formats (HLS, concat) whose demuxers open
further URLs and files themselves, which would walk around the fetch policy.

Frames are sampled as Qwen's video processors sample them: the number is duration x target
fps, at least min_frames (4, transformers' Qwen2-VL / Qwen3-VL default; fewer only when the
source has fewer), at most max_frames, spread uniformly over the source's frames
(np.linspace over the frame indices, rounded). Fewer are kept when that many frames of this size
would pass max_total_pixels; a single frame over max_frame_pixels is refused, from the stream's
header, before anything is decoded. Decoding stops at the wall timeout.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np

from metrale.multimodal.errors import MediaError

# signature -> the FFmpeg demuxer
_CONTAINERS = (("mp4", lambda b: b[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip")),
               ("matroska", lambda b: b[:4] == b"\x1a\x45\xdf\xa3"),  # Matroska and WebM
               ("avi", lambda b: b[:4] == b"RIFF" and b[8:12] == b"AVI "))


@dataclass
class DecodedVideo:
    frames: np.ndarray  # uint8 [T, H, W, 3], RGB
    fps: float  # of the source the frames were sampled from
    frame_indices: list[int]  # each kept frame's index in the source
    duration_s: float  # of the source


@dataclass(frozen=True)
class VideoDecodePolicy:
    target_fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 64
    max_frame_pixels: int = 64 << 20
    max_total_pixels: int = 128 << 20  # over all kept frames: bounds the decoded array (3 bytes a pixel)
    timeout_s: float = 30.0


def container_format(data: bytes) -> str:
    for name, matches in _CONTAINERS:
        if matches(data[:16]):
            return name
    raise MediaError("the video is not MP4/MOV, Matroska/WebM or AVI")


def sample_indices(total_frames: int, source_fps: float, policy: VideoDecodePolicy, frame_pixels: int) -> list[int]:
    """Which source frames to keep, uniformly spread, as many as the policy allows."""
    wanted = int(total_frames / source_fps * policy.target_fps) if source_fps > 0 else policy.max_frames
    by_pixels = policy.max_total_pixels // max(1, frame_pixels)
    count = max(1, min(max(wanted, policy.min_frames), policy.max_frames, by_pixels, total_frames))
    return sorted(set(np.linspace(0, total_frames - 1, count).round().astype(int).tolist()))


def decode_video(data: bytes, policy: VideoDecodePolicy = VideoDecodePolicy()) -> DecodedVideo:
    import av  # imported with the first video: FFmpeg's libraries are large

    fmt = container_format(data)
    deadline = time.monotonic() + policy.timeout_s
    try:
        total, fps, duration, size = _probe(av, data, fmt, policy)
        indices = sample_indices(total, fps, policy, size[0] * size[1])
        frames, kept = _decode_frames(av, data, fmt, indices, deadline, policy)
    except MediaError:
        raise
    except Exception:  # noqa: BLE001 - av.error.*, malformed headers: the client needs none of FFmpeg's words
        raise MediaError("the video could not be decoded") from None
    if not frames:
        raise MediaError("the video could not be decoded (no frames)")
    return DecodedVideo(np.stack(frames), fps, kept, duration)


def _probe(av, data: bytes, fmt: str, policy: VideoDecodePolicy) -> tuple[int, float, float, tuple[int, int]]:
    """(frame count, fps, duration in s, (width, height)) from the headers; the count by demuxing
    (no decoding) when the container does not state it."""
    with av.open(io.BytesIO(data), format=fmt) as container:
        if not container.streams.video:
            raise MediaError("the video could not be decoded (no video stream)")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > policy.max_frame_pixels:
            raise MediaError(f"the video's frames are {width} x {height} pixels, more than the "
                             f"{policy.max_frame_pixels:,} allowed")
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        if stream.duration and stream.time_base:
            duration = float(stream.duration * stream.time_base)
        elif container.duration:
            duration = container.duration / 1e6
        else:
            duration = total / fps if fps else 0.0
    if total < 1:
        raise MediaError("the video could not be decoded (no frames)")
    if fps <= 0:
        fps = total / duration if duration > 0 else 1.0
    return total, fps, duration, (width, height)


def _decode_frames(av, data: bytes, fmt: str, indices: list[int], deadline: float,
                   policy: VideoDecodePolicy) -> tuple[list[np.ndarray], list[int]]:
    wanted, frames, kept = set(indices), [], []
    with av.open(io.BytesIO(data), format=fmt) as container:
        stream = container.streams.video[0]
        for index, frame in enumerate(container.decode(stream)):
            if time.monotonic() > deadline:
                raise MediaError(f"decoding the video took longer than the {policy.timeout_s:g} s allowed")
            if index in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
                kept.append(index)
            if index >= indices[-1]:
                break
    shapes = {f.shape for f in frames}
    if len(shapes) > 1:
        raise MediaError("the video's frames change size; refused")
    return frames, kept
