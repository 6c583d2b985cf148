"""Video on Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 (frame timestamps written as text into the prompt)
through the engine, against transformers:

- the expanded token ids, pixel values and grid equal transformers' Qwen3VLProcessor.__call__ for
  the same frames and metadata (its own text expansion, replace_video_token, and tokenization;
  only the video processor, which needs torchvision, is a stand-in that returns the video's
  pixel values from the checkpoint's image processor frame by frame);
- frame sampling by fps / max_frames equals Qwen3VLVideoProcessor.sample_frames;
- the M-RoPE positions equal the model's get_rope_index;
- greedy tokens equal Qwen3VLForConditionalGeneration.generate (and the MoE / Qwen3.5 classes)
  in float32, a video prompt batched with an image prompt and a text-only prompt, chunked;
- two different videos share no KV past the text before them; LLM.chat with a data: video_url.
"""

from __future__ import annotations

import base64
from unittest import mock

import numpy as np
import pytest
import torch

from media_servers import mp4_bytes
from test_vl_engine import NEW_TOKENS, greedy, text_ids
from vl_checkpoints import make_vl_checkpoint, tiny_images, tiny_video, video_pixel_values
from vl_reference import Media, reference_greedy_vl

from metrale import LLM
from metrale.messages.errors import InvalidRequestError
from metrale.multimodal.timestamped_video import SourceFrames
from metrale.multimodal.video_decode import DecodedVideo, decode_video

CLASSES = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
           "qwen3_5_vl": "Qwen3_5ForConditionalGeneration"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {family: make_vl_checkpoint(str(tmp_path_factory.mktemp(family)), family) for family in CLASSES}


@pytest.fixture(scope="module")
def references(checkpoints):
    import transformers

    return {family: getattr(transformers, CLASSES[family]).from_pretrained(path, dtype=torch.float32).eval()
            for family, path in checkpoints.items()}


def hf_processor(path: str, metadata: list):
    """transformers' Qwen3VLProcessor with a stand-in video processor: the pixel values of the
    frames it gets (tests/vl_checkpoints.py video_pixel_values) and the given metadata."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.feature_extraction_utils import BatchFeature
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    image_processor = AutoImageProcessor.from_pretrained(path)

    class FramesAsGiven:
        merge_size, temporal_patch_size = image_processor.merge_size, image_processor.temporal_patch_size

        def __call__(self, videos, **kwargs):
            # patchify's padding: the last frame repeated to fill the final temporal patch
            padded = [np.concatenate([v, np.repeat(v[-1:], -len(v) % self.temporal_patch_size, axis=0)])
                      for v in map(np.asarray, videos)]
            pixels, grids = zip(*(video_pixel_values(image_processor, v) for v in padded))
            return BatchFeature({"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.cat(grids),
                                 "video_metadata": metadata})

    # Without torchvision, the class check trips over transformers' placeholder video mapping.
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(path),
                                video_processor=FramesAsGiven())


def hf_inputs(path: str, text: str, videos: list[DecodedVideo], images=None) -> dict:
    from transformers.video_utils import VideoMetadata

    metadata = [VideoMetadata(total_num_frames=max(v.frame_indices) + 1, fps=v.fps,
                              frames_indices=list(v.frame_indices))  # transformers pads the list in place
                for v in videos]
    return hf_processor(path, metadata)(text=[text], images=images, videos=[v.frames for v in videos],
                                        return_tensors="pt")


def clip(frames: int = 4, seed: int = 1) -> DecodedVideo:
    """Frames kept at source indices 0, 2, 4, ... of a 3 fps source (a rate the timestamps show)."""
    rng = np.random.default_rng(seed)
    indices = list(range(0, 2 * frames, 2))
    return DecodedVideo(rng.integers(0, 256, (frames, 56, 84, 3), dtype=np.uint8), 3.0, indices, 2 * frames / 3.0)


VIDEO_TEXT = "Watch<|vision_start|><|video_pad|><|vision_end|> and tell"


def engine_prompt(text: str, video, **extra) -> dict:
    return {"prompt": text, "multi_modal_data": {"video": video, **extra}}


def test_expansion_pixels_and_positions_equal_transformers(checkpoints, references):
    path = checkpoints["qwen3_vl"]
    llm = LLM(path, dtype="float32", device="cpu")
    processor = llm.llm_engine.mm_processor
    tokenizer = llm.get_tokenizer()
    a, _ = tiny_images()
    text = "An image<|vision_start|><|image_pad|><|vision_end|>, a clip" + VIDEO_TEXT[5:] + ", and another" \
           "<|vision_start|><|video_pad|><|vision_end|>."
    # 4 frames (2 patches), 3 frames (the last repeated: timestamps (4 + 4) / 2 / 3 s)
    videos = [clip(4), clip(3, seed=2)]
    expected = hf_inputs(path, text, videos, images=[a])
    ids = tokenizer.encode(text, add_special_tokens=False)
    mm = processor.process(ids, {"image": a, "video": videos}, None)
    assert mm.token_ids == expected["input_ids"][0].tolist()
    assert "<0.3 seconds>" in tokenizer.decode(mm.token_ids) and "<1.3 seconds>" in tokenizer.decode(mm.token_ids)
    got = [item for item in mm.items if item.modality == "video"]
    assert [item.grid_thw for item in got] == [tuple(g) for g in expected["video_grid_thw"].tolist()]
    assert np.array_equal(np.concatenate([item.pixel_values for item in got]), expected["pixel_values_videos"].numpy())
    start, end = processor.vl_config.vision_start_token_id, processor.vl_config.vision_end_token_id
    for item in got:  # the span runs from the first timestamp to the last frame's vision_end
        span = mm.token_ids[item.offset:item.end]
        assert span.count(processor.token_ids["video"]) == item.num_embeds
        assert mm.token_ids[item.offset - 1] == start and span[0] != start and span[-1] == end
    positions, delta = references["qwen3_vl"].model.get_rope_index(
        expected["input_ids"], expected["mm_token_type_ids"], expected["image_grid_thw"], expected["video_grid_thw"])
    assert np.array_equal(mm.mrope_positions, positions[:, 0].numpy()) and mm.mrope_delta == int(delta)


def test_sampling_follows_transformers_sample_frames(checkpoints):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    processor = LLM(checkpoints["qwen3_vl"], dtype="float32", device="cpu").llm_engine.mm_processor
    timestamped = processor.timestamped_video
    reference = Qwen3VLVideoProcessor.from_pretrained(checkpoints["qwen3_vl"])
    # 12 frames kept at 2 fps from a 30 fps source (6 s).
    video = DecodedVideo(tiny_video(frames=12), 30.0, list(range(0, 180, 15)), 6.0)
    source_rate = VideoMetadata(total_num_frames=12, fps=2.0)
    for kwargs in ({"fps": 1}, {"fps": 0.5}, {"fps": 1, "max_frames": 5}, {"max_frames": 3}):
        picked = timestamped.sample(SourceFrames(video), kwargs)
        if "max_frames" in kwargs:
            reference.max_frames = kwargs["max_frames"]
        want = reference.sample_frames(source_rate, fps=kwargs.get("fps", reference.fps)).tolist()
        reference.max_frames = 768
        assert picked == want, kwargs
    # Unasked, the frames given are kept; fps 0.5 of 6 s is 3 frames, raised to min_frames (4).
    assert timestamped.sample(SourceFrames(video), {}) == list(range(12))
    pad = processor.token_ids["video"]
    mm = processor.process([5, pad, 6], {"video": video}, {"fps": 0.5})
    assert mm.items[0].grid_thw[0] == 2  # 4 frames
    with pytest.raises(InvalidRequestError, match="max_pixels 10 per video frame is below one 28x28 patch group"):
        processor.process([5, pad, 6], {"video": video}, {"max_pixels": 10})
    with pytest.raises(InvalidRequestError, match="a DecodedVideo needs one frame index per frame"):
        processor.process([5, pad, 6], {"video": DecodedVideo(video.frames, 30.0, [0], 6.0)}, None)
