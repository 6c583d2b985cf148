"""The media processor alone: video frame sampling by fps / max_frames from a DecodedVideo, the
seconds per temporal patch it hands the M-RoPE positions, content hashes, and bad values refused."""

from __future__ import annotations

import numpy as np
import pytest

from vl_checkpoints import make_vl_checkpoint, tiny_images, tiny_video

from metrale import LLM
from metrale.messages.errors import InvalidRequestError
from metrale.multimodal.video_decode import DecodedVideo


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    path = make_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_5_vl_proc")), "qwen2_5_vl")
    return LLM(path, dtype="float32", device="cpu").llm_engine.mm_processor


def video_prompt(processor) -> list[int]:
    return [5, processor.vl_config.vision_start_token_id, processor.token_ids["video"],
            processor.vl_config.vision_end_token_id, 6]


def test_video_sampling_by_fps_and_max_frames(processor):
    frames = tiny_video(frames=8)
    video = DecodedVideo(frames, fps=30.0, frame_indices=list(range(0, 120, 15)), duration_s=4.0)  # 2 fps kept
    item = processor.process(video_prompt(processor), {"video": video}, None).items[0]
    assert item.grid_thw[0] == 4 and item.second_per_grid_t == pytest.approx(1.0)
    item = processor.process(video_prompt(processor), {"video": video}, {"fps": 1}).items[0]
    assert item.grid_thw[0] == 2 and item.second_per_grid_t == pytest.approx(2.0)
    item = processor.process(video_prompt(processor), {"video": video}, {"max_frames": 2}).items[0]
    assert item.grid_thw[0] == 1
    # vLLM's (frames, metadata): the same video, its rate from the source's duration
    pair = (frames, {"fps": 30.0, "frames_indices": list(range(0, 120, 15)), "duration": 4.0})
    item = processor.process(video_prompt(processor), {"video": pair}, None).items[0]
    assert item.grid_thw[0] == 4 and item.second_per_grid_t == pytest.approx(1.0)


def test_content_hash_is_of_the_pixels(processor):
    a, b = tiny_images()
    ids = [5, processor.vl_config.vision_start_token_id, processor.token_ids["image"],
           processor.vl_config.vision_end_token_id]
    first = processor.process(ids, {"image": a}, None).items[0]
    again = processor.process(ids, {"image": a.copy()}, None).items[0]
    flipped = processor.process(ids, {"image": a.transpose(0)}, None).items[0]
    assert first.content_hash == again.content_hash != flipped.content_hash
    with pytest.raises(InvalidRequestError, match="max_pixels must be a positive number"):
        processor.process(ids, {"image": a}, {"max_pixels": -1})
    with pytest.raises(InvalidRequestError, match="an image must be a PIL.Image, not ndarray"):
        processor.process(ids, {"image": np.zeros((4, 4, 3), dtype=np.uint8)}, None)
    with pytest.raises(InvalidRequestError, match=r"a video is uint8 frames \[T, H, W, 3\]"):
        processor.process(video_prompt(processor), {"video": np.zeros((2, 4, 4), dtype=np.uint8)}, None)
