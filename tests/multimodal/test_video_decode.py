"""Video decoding with PyAV: uniform sampling by fps under the frame, pixel and time caps; a
corrupt or unknown container is a MediaError that says nothing of FFmpeg's insides."""

from __future__ import annotations

import numpy as np
import pytest

from media_servers import mp4_bytes
from metrale.multimodal.errors import MediaError
from metrale.multimodal.video_decode import VideoDecodePolicy, decode_video, sample_indices


@pytest.fixture(scope="module")
def clip() -> bytes:
    return mp4_bytes(frames=20, fps=10)  # 2 s, frame i of gray level 10 * i


def refused(data: bytes, policy: VideoDecodePolicy = VideoDecodePolicy()) -> str:
    with pytest.raises(MediaError) as info:
        decode_video(data, policy)
    assert "0x" not in str(info.value)
    return str(info.value)


def test_sampled_at_2_fps(clip):
    video = decode_video(clip)
    assert video.frames.dtype == np.uint8 and video.frames.shape == (4, 24, 32, 3)
    assert video.frame_indices == [0, 6, 13, 19]  # np.linspace(0, 19, 2 s * 2 fps).round()
    assert video.fps == 10.0 and video.duration_s == pytest.approx(2.0)
    gray = video.frames.mean(axis=(1, 2, 3))
    assert np.allclose(gray, [10 * i for i in video.frame_indices], atol=4)  # the frames kept are those


def test_caps(clip):
    assert decode_video(clip, VideoDecodePolicy(target_fps=100)).frame_indices == list(range(20))
    assert decode_video(clip, VideoDecodePolicy(target_fps=100, max_frames=3)).frame_indices == [0, 10, 19]
    # Total pixels: 2 frames of 32 x 24 fit, not 3.
    assert len(decode_video(clip, VideoDecodePolicy(target_fps=100, max_total_pixels=2 * 32 * 24 + 1)).frames) == 2
    assert "32 x 24 pixels" in refused(clip, VideoDecodePolicy(max_frame_pixels=32 * 24 - 1))
    assert "longer than" in refused(clip, VideoDecodePolicy(timeout_s=1e-9))


def test_sample_indices_match_qwen_processors():
    # transformers' Qwen2-VL video processor: int(total / fps * target), clamped, np.linspace(...).round()
    assert sample_indices(300, 30.0, VideoDecodePolicy(), 1) == np.linspace(0, 299, 20).round().astype(int).tolist()
    assert sample_indices(10000, 25.0, VideoDecodePolicy(max_frames=64), 1) == \
        np.linspace(0, 9999, 64).round().astype(int).tolist()
    # min_frames (4): a 0.1 s clip keeps every frame it has, a 1 s one 4 rather than 2 s x fps
    assert sample_indices(3, 30.0, VideoDecodePolicy(), 1) == [0, 1, 2]
    assert sample_indices(30, 30.0, VideoDecodePolicy(), 1) == np.linspace(0, 29, 4).round().astype(int).tolist()
    assert sample_indices(30, 30.0, VideoDecodePolicy(max_frames=3), 1) == [0, 14, 29]


@pytest.mark.parametrize("make", [lambda c: c[:200], lambda c: c[:48] + b"\0" * 600 + c[648:],
                                  lambda c: b"\x1a\x45\xdf\xa3" + b"\0" * 200, lambda c: b"RIFF\0\0\0\0AVI " + b"\1" * 64])
def test_corrupt_video(clip, make):
    assert refused(make(clip)).startswith("the video could not be decoded")


@pytest.mark.parametrize("data", [b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n", b"ffconcat version 1.0\nfile /etc/passwd\n",
                                  b"hello", b""])
def test_playlists_and_unknown_containers_are_never_probed(data):
    assert refused(data) == "the video is not MP4/MOV, Matroska/WebM or AVI"


def test_matroska():
    import io

    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuv420p"
        for i in range(8):
            frame = av.VideoFrame.from_ndarray(np.full((16, 16, 3), 20 * i, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    video = decode_video(buffer.getvalue())
    assert video.frames.shape == (4, 16, 16, 3) and video.frame_indices == [0, 2, 5, 7]
