"""Video on Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE (frame timestamps written as text into the prompt)
through the engine, against transformers:

- the expanded token ids, pixel values and grid equal transformers' Qwen3VLProcessor.__call__ for
  the same frames and metadata (its own text expansion, replace_video_token, and tokenization;
  only the video processor, which needs torchvision, is a stand-in that returns the video's
  pixel values from the checkpoint's image processor frame by frame);
- frame sampling by fps / max_frames equals Qwen3VLVideoProcessor.sample_frames;
- the M-RoPE positions equal the model's get_rope_index;
- greedy tokens equal Qwen3VLForConditionalGeneration.generate (and the MoE / Qwen3.5 classes)
  in float32, a video prompt batched with an image prompt and a text-only prompt, chunked;
- two different videos share no KV past the text before them; LLM.chat and the server with a
  data: video_url.
"""

from __future__ import annotations

import base64
from unittest import mock

import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from media_servers import mp4_bytes
from test_vl_engine import NEW_TOKENS, greedy, text_ids
from vl_checkpoints import make_vl_checkpoint, tiny_images, tiny_video, video_pixel_values
from vl_reference import Media, reference_greedy_vl

from metrale import LLM
from metrale.messages.errors import InvalidRequestError
from metrale.multimodal.timestamped_video import SourceFrames
from metrale.multimodal.video_decode import DecodedVideo, decode_video

CLASSES = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
           "qwen3_5_vl": "Qwen3_5ForConditionalGeneration",
           "qwen3_5_moe_vl": "Qwen3_5MoeForConditionalGeneration"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {family: make_vl_checkpoint(str(tmp_path_factory.mktemp(family)), family) for family in CLASSES}


@pytest.fixture(scope="module")
def references(checkpoints):
    import transformers

    return {family: getattr(transformers, CLASSES[family]).from_pretrained(path, dtype=torch.float32).eval()
            for family, path in checkpoints.items()}


def hf_processor(path: str, metadata: list):
    """transformers' Qwen3VLProcessor with a stand-in video processor (transformers' needs
    torchvision): each video sized by transformers' Qwen3-VL smart_resize over the clip (the
    checkpoint's video bounds), resized with PIL (bicubic), then rescaled, normalized and
    patchified by the checkpoint's image processor frame by frame (tests/vl_checkpoints.py
    video_pixel_values); the given metadata is returned with it."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.feature_extraction_utils import BatchFeature
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.processing_utils import ProcessorMixin

    image_processor = AutoImageProcessor.from_pretrained(path)
    frame_processor = AutoImageProcessor.from_pretrained(path, do_resize=False)
    bounds = Qwen3VLVideoProcessor.from_pretrained(path).size

    class FramesAsGiven:
        merge_size, temporal_patch_size = image_processor.merge_size, image_processor.temporal_patch_size

        def frames(self, video: np.ndarray) -> np.ndarray:
            tp = self.temporal_patch_size
            height, width = smart_resize(len(video), *video.shape[1:3], temporal_factor=tp,
                                         factor=image_processor.patch_size * self.merge_size,
                                         min_pixels=bounds.shortest_edge, max_pixels=bounds.longest_edge)
            video = np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.BICUBIC))
                              for f in video])
            # patchify's padding: the last frame repeated to fill the final temporal patch
            return np.concatenate([video, np.repeat(video[-1:], -len(video) % tp, axis=0)])

        def __call__(self, videos, **kwargs):
            pixels, grids = zip(*(video_pixel_values(frame_processor, self.frames(np.asarray(v))) for v in videos))
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


def test_bare_frames_count_at_2_fps_and_one_frame_fills_a_patch(checkpoints):
    path = checkpoints["qwen3_vl"]
    llm = LLM(path, dtype="float32", device="cpu")
    processor, tokenizer = llm.llm_engine.mm_processor, llm.get_tokenizer()
    ids = tokenizer.encode(VIDEO_TEXT, add_special_tokens=False)
    frames = tiny_video(frames=4)
    as_decoded = DecodedVideo(frames, 2.0, [0, 1, 2, 3], 2.0)
    assert processor.process(ids, {"video": frames}, None).token_ids == \
        hf_inputs(path, VIDEO_TEXT, [as_decoded])["input_ids"][0].tolist()
    one = processor.process(ids, {"video": DecodedVideo(frames[:1], 30.0, [15], 1.0)}, None)
    assert one.items[0].grid_thw == (1, 4, 6) and "<0.5 seconds>" in tokenizer.decode(one.token_ids)


def test_frames_with_vllm_metadata(checkpoints):
    """vLLM's (frames, metadata): the timestamps come from its fps and frames_indices."""
    path = checkpoints["qwen3_vl"]
    llm = LLM(path, dtype="float32", device="cpu")
    processor, tokenizer = llm.llm_engine.mm_processor, llm.get_tokenizer()
    ids = tokenizer.encode(VIDEO_TEXT, add_special_tokens=False)
    video = clip(4)
    pair = (video.frames, {"fps": 3.0, "frames_indices": video.frame_indices, "total_num_frames": 8,
                           "video_backend": "opencv"})
    expected = hf_inputs(path, VIDEO_TEXT, [video])["input_ids"][0].tolist()
    assert processor.process(ids, {"video": pair}, None).token_ids == expected
    assert processor.process(ids, {"video": [pair]}, None).token_ids == expected
    refusals = {r"fps \(of the source\) is required": {},
                "unknown key.*'start'": {"fps": 3.0, "start": 1},
                "do_sample_frames true is not supported": {"fps": 3.0, "do_sample_frames": True},
                "fps must be a positive number": {"fps": -1},
                "frames_indices must be one increasing index per frame": {"fps": 3.0, "frames_indices": [0, 1]}}
    for message, metadata in refusals.items():
        with pytest.raises(InvalidRequestError, match=message):
            processor.process(ids, {"video": (video.frames, metadata)}, None)


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


def hf_greedy(reference, path: str, text: str, videos=(), images=None) -> list[int]:
    inputs = hf_inputs(path, text, list(videos), images=images) if videos else \
        hf_processor(path, [])(text=[text], images=images, return_tensors="pt")
    vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    return reference_greedy_vl(reference, inputs["input_ids"][0].tolist(), NEW_TOKENS, **vision)


@pytest.mark.parametrize("family", list(CLASSES))
def test_video_batched_with_an_image_and_text_equals_transformers(checkpoints, references, family):
    path, reference = checkpoints[family], references[family]
    a, _ = tiny_images()
    video = clip(3)  # 2 temporal patches, the last of one frame twice
    image_text = "Look<|vision_start|><|image_pad|><|vision_end|> here"
    plain = "A paged KV cache stores keys"
    expected = [hf_greedy(reference, path, VIDEO_TEXT, [video]), hf_greedy(reference, path, image_text, images=[a]),
                hf_greedy(reference, path, plain)]
    # Chunks of 8 tokens split the video's span, between and inside its frames.
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=8)
    outs = llm.generate([engine_prompt(VIDEO_TEXT, video), {"prompt": image_text, "multi_modal_data": {"image": a}},
                         {"prompt": plain}], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_prefix_hits_only_for_the_same_video(checkpoints):
    llm = LLM(checkpoints["qwen3_vl"], dtype="float32", device="cpu", block_size=4)
    engine = llm.llm_engine
    text = "A paged KV cache stores keys and values in" + VIDEO_TEXT
    span = engine.mm_processor.process(engine.tokenizer.encode(text, add_special_tokens=False),
                                       {"video": clip(4)}, None).items[0]

    def hits(video) -> int:
        before = engine.scheduler.kv.prefix_hits_total
        llm.generate([engine_prompt(text, video)], greedy(2), use_tqdm=False)
        return engine.scheduler.kv.prefix_hits_total - before

    hits(clip(4))
    other = hits(clip(4, seed=5))  # the same grid and timestamps: the same token ids, other pixels
    assert 0 < other <= span.offset // 4 * 4  # the text before the video only
    assert hits(clip(4)) >= span.end  # past the video


def test_llm_chat_with_a_video_url(checkpoints, references):
    """A data: video_url part: fetched, decoded (PyAV: 4 of 20 frames at 10 fps), processed."""
    path = checkpoints["qwen3_vl"]
    data = mp4_bytes(frames=20, fps=10)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    rendered = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n"
                "<|im_start|>assistant\n")
    expected = hf_greedy(references["qwen3_vl"], path, rendered, [decode_video(data)])
    llm = LLM(path, dtype="float32", device="cpu")
    out = llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                 {"type": "text", "text": "What happens?"}]}], greedy(), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected
    assert "<0.3 seconds>" in llm.get_tokenizer().decode(out[0].prompt_token_ids)  # frames 0 and 6 of 10 fps


def test_video_url_through_the_server(checkpoints, references, tmp_path):
    """The server's video_url part (a data: MP4) on Qwen3-VL: transformers' greedy text; a second
    video over --limit-mm-per-prompt is a 400 naming it and the server goes on serving."""
    from server_process import ServerProcess

    path = checkpoints["qwen3_vl"]
    data = mp4_bytes(frames=20, fps=10)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    rendered = ("<|im_start|>user\nWhat happens?<|vision_start|><|video_pad|><|vision_end|><|im_end|>\n"
                "<|im_start|>assistant\n")
    expected = hf_greedy(references["qwen3_vl"], path, rendered, [decode_video(data)])
    server = ServerProcess(path, str(tmp_path / "serve.log"), "--limit-mm-per-prompt", '{"video": 1}')
    try:
        server.wait_ready()
        client = server.client(timeout=60)
        content = [{"type": "text", "text": "What happens?"}, {"type": "video_url", "video_url": {"url": url}}]
        ask = dict(model=path, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        reply = client.chat.completions.create(messages=[{"role": "user", "content": content}], **ask)
        assert reply.choices[0].message.content == AutoTokenizer.from_pretrained(path).decode(expected)
        with pytest.raises(openai.BadRequestError, match="limit-mm-per-prompt"):
            client.chat.completions.create(messages=[{"role": "user", "content": content + content[1:]}], **ask)
        again = client.chat.completions.create(messages=[{"role": "user", "content": content}], **ask)
        assert again.choices[0].message.content == reply.choices[0].message.content
    finally:
        code = server.stop()
    assert code == 0, server.log()


def test_pixel_caps_per_frame_and_refusals_by_name(checkpoints):
    from metrale.multimodal.timestamped_video import TimestampedVideo

    processor = LLM(checkpoints["qwen3_5_vl"], dtype="float32", device="cpu",
                    vision_max_pixels=56 * 56).llm_engine.mm_processor
    pad = processor.token_ids["video"]
    # 56 x 84 frames: --vision-max-pixels (56 x 56) caps each frame, a request's max_pixels lower still
    assert processor.process([5, pad], {"video": clip(4)}, None).items[0].grid_thw == (2, 2, 4)
    assert processor.process([5, pad], {"video": clip(4)}, {"max_pixels": 28 * 56}).items[0].grid_thw == (2, 2, 2)
    without = TimestampedVideo(checkpoints["qwen3_5_vl"], processor.vl_config, None,
                               processor.timestamped_video.frame_timestamps)
    with pytest.raises(InvalidRequestError, match="needs the tokenizer to write each frame's timestamp"):
        without.process(clip(2), {}, None)
    with pytest.raises(InvalidRequestError, match=r"a video is uint8 frames \[T, H, W, 3\]"):
        processor.process([5, pad], {"video": np.zeros((2, 4, 4), dtype=np.uint8)}, None)
    with pytest.raises(InvalidRequestError, match="mm_processor_kwargs: unknown key.*'num_frames'"):
        processor.process([5, pad], {"video": clip(2)}, {"num_frames": 4})
