"""Qwen3-VL's parts against transformers, float32, on a tiny random checkpoint with its image
processor (two images of 56x56 and 84x112 pixels, a 4-frame video = 2 temporal patches; the
learned 4x4 position table resampled to both grids; DeepStack after vision blocks 0 and 1):

- the vision tower == `model.visual` (main rows and both DeepStack features);
- `mrope_positions` == `get_rope_index` (text only, 1 image, 2 images, image + video, a video
  split into per-frame runs with timestamp text between them);
- text-only prompts through `LLM` and a tp=2 engine == transformers' greedy;
- an image + video prompt through `forward(multimodal=...)` (DeepStack added after decoder
  layers 0 and 1) in chunks of 16 == transformers' generate;
- the MoE variant (Qwen3VLMoeForConditionalGeneration) likewise;
- frame timestamps == the processor's.
"""

import random

import pytest
import torch

from checkpoints import reference_greedy
from parallel_cases import free_port
from vl_checkpoints import make_vl_checkpoint
from vl_reference import Media, drive_multimodal, reference_greedy_vl

from metrale import LLM, SamplingParams

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_vl_checkpoint(str(tmp_path_factory.mktemp("qwen3_vl")), "qwen3_vl")


@pytest.fixture(scope="module")
def reference(checkpoint):
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def media(checkpoint):
    return Media(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, dtype="float32", device="cpu", max_num_batched_tokens=64)


def _model(llm):
    return llm.llm_engine.runner.model


def text_prompts():
    rng = random.Random(1)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 9, 70)]


def greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@torch.no_grad()
def test_vision_tower_and_deepstack_match_transformers(llm, reference, media):
    model = _model(llm)
    assert model.multimodal_width == 64 * 3
    for modality, pixels, grid in (("image", media.image_pixels, media.image_grid),
                                   ("video", media.video_pixels, media.video_grid)):
        ours = model.embed_multimodal(modality, pixels, grid)
        out = reference.model.visual(pixels, grid_thw=grid)
        expected = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
        assert [o.shape[0] for o in ours] == [media.tokens(g) for g in grid]
        torch.testing.assert_close(torch.cat(ours), expected, rtol=1e-4, atol=1e-4)


def _prompts(media):
    text = [5, 6, 7]
    image0, image1 = (media.placeholder("image", g) for g in media.image_grid)
    video = media.placeholder("video", media.video_grid[0], frames_as_items=True)
    g_img, g_vid = media.image_grid, media.video_grid
    return {
        "text only": (text + [8, 9], {}),
        "one image": (text + image0 + [8, 9], dict(image_grid_thw=g_img[:1])),
        "two images": (text + image0 + [10] + image1 + [8], dict(image_grid_thw=g_img)),
        "image and video": (text + image1 + video + [8], dict(image_grid_thw=g_img[1:], video_grid_thw=g_vid)),
        "video frames": (text + video + [8, 9], dict(video_grid_thw=g_vid)),
    }


@pytest.mark.parametrize("case", ["text only", "one image", "two images", "image and video", "video frames"])
def test_mrope_positions_match_get_rope_index(reference, media, case):
    from metrale.models.qwen3_vl import Qwen3VLForConditionalGeneration as ours

    ids, grids = _prompts(media)[case]
    positions, delta = ours.mrope_positions(reference.config, ids, **grids)
    if case == "text only":
        expected, expected_delta = torch.arange(len(ids)).expand(3, -1), 0
    else:
        # transformers splits video_grid_thw in place: give it a copy.
        grids = {k: v.clone() for k, v in grids.items()}
        expected, expected_delta = reference.model.get_rope_index(torch.tensor([ids]), media.token_types(ids), **grids)
        expected, expected_delta = expected[:, 0], int(expected_delta)
    assert positions.shape == (3, len(ids))
    assert positions.tolist() == expected.tolist() and delta == expected_delta


def test_text_only_greedy_matches_transformers(llm, reference):
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in text_prompts()]
    assert greedy(llm, text_prompts()) == expected


def _image_video_prompt(media):
    image0, image1 = (media.placeholder("image", g) for g in media.image_grid)
    video = media.placeholder("video", media.video_grid[0], frames_as_items=True)
    return [5, 6] + image0 + [7] + video + [8] + image1 + [9, 10]


def _drive(llm, media, ids, embeds=None):
    """The model of `llm` set to take `ids` with the test media (or `embeds`) in prompt order."""
    model = _model(llm)
    positions, delta = model.mrope_positions(model.vl_config, ids, media.image_grid, media.video_grid)
    if embeds is None:
        with torch.no_grad():
            images = model.embed_multimodal("image", media.image_pixels, media.image_grid)
            (clip,) = model.embed_multimodal("video", media.video_pixels, media.video_grid)
        embeds = torch.cat([images[0], clip, images[1]])
    drive_multimodal(model, ids, positions, delta, embeds, {media.ids["<|image_pad|>"], media.ids["<|video_pad|>"]})
    return embeds


def _expected(reference, media, ids):
    return reference_greedy_vl(reference, ids, NEW_TOKENS, pixel_values=media.image_pixels,
                               image_grid_thw=media.image_grid, pixel_values_videos=media.video_pixels,
                               video_grid_thw=media.video_grid.clone(), mm_token_type_ids=media.token_types(ids))


def test_images_and_video_with_deepstack_through_forward_match_transformers(checkpoint, reference, media):
    ids = _image_video_prompt(media)
    expected = _expected(reference, media, ids)
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_num_batched_tokens=16)
    embeds = _drive(llm, media, ids)
    assert greedy(llm, [ids]) == [expected]
    # Without the DeepStack rows the continuation differs: they are used.
    _drive(llm, media, ids, torch.cat([embeds[:, :64], 0 * embeds[:, 64:]], dim=-1))
    assert greedy(llm, [ids]) != [expected]


def test_moe_variant_matches_transformers(tmp_path, media):
    """Qwen3-VL-MoE (layer 1 sparse: 4 experts, top 2; transformers' stacked expert tensors):
    text-only and image + video greedy == transformers."""
    import transformers

    path = make_vl_checkpoint(str(tmp_path / "moe"), "qwen3_vl_moe")
    reference = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ids = _image_video_prompt(media)
    expected = _expected(reference, media, ids)
    text = [reference_greedy(reference, p, NEW_TOKENS) for p in text_prompts()]
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=16)
    assert greedy(llm, text_prompts()) == text
    _drive(llm, media, ids)
    assert greedy(llm, [ids]) == [expected]


def test_tensor_parallel_text_only_matches_transformers(checkpoint, reference):
    """Two ranks: the text part sharded, the vision tower whole on each."""
    llm = LLM(checkpoint, dtype="float32", device="cpu", tp_size=2, master_port=free_port())
    try:
        assert llm.llm_engine.executor.world_size == 2
        expected = [reference_greedy(reference, p, NEW_TOKENS) for p in text_prompts()]
        assert greedy(llm, text_prompts()) == expected
    finally:
        llm.llm_engine.shutdown()


def test_frame_timestamps_match_the_processor():
    from transformers import Qwen3VLProcessor

    from metrale.models.qwen3_vl import frame_timestamps

    for indices, fps in (([0, 12, 24, 36], 24.0), ([0, 5, 10], 2.0), ([3], 30.0)):
        assert frame_timestamps(indices, fps) == Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
    with pytest.raises(ValueError, match="fps must be positive"):
        frame_timestamps([0, 1], 0.0)


def test_a_text_config_is_refused_for_positions(llm, media):
    from metrale.models.qwen3_vl import Qwen3VLForConditionalGeneration as ours

    with pytest.raises(ValueError, match="whole config"):
        ours.mrope_positions(_model(llm).config.hf_config, [5, 6])
