"""Qwen2.5-VL's parts against transformers, float32, on a tiny random checkpoint with its
processor (two images of 56x56 and 84x112 pixels, a 4-frame video = 2 temporal patches):

- the vision tower (window attention, full-attention block, merger) == `model.visual`;
- `mrope_positions` == `get_rope_index` (text only, 1 image, 2 images, image + video, a video
  with second_per_grid_ts);
- text-only prompts through `LLM` (batched, chunked, preempted) and a tp=2 engine == transformers' greedy;
- an image + video prompt through the model's `forward(multimodal=...)` == transformers' greedy
  (the engine's plumbing stood in for by tests/vl_reference.py), with chunked prefill;
- transformers 5.x checkpoint names, a 4.x config.json and tied embeddings load; bad inputs are refused by name.
"""

import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import reference_greedy
from parallel_cases import free_port
from vl_checkpoints import make_vl_checkpoint
from vl_reference import Media, drive_multimodal, reference_greedy_vl

from metrale import LLM, SamplingParams

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_5_vl")), "qwen2_5_vl")


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
    rng = random.Random(0)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 9, 70)]


def greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@torch.no_grad()
def test_vision_tower_matches_transformers(llm, reference, media):
    model = _model(llm)
    for modality, pixels, grid in (("image", media.image_pixels, media.image_grid),
                                   ("video", media.video_pixels, media.video_grid)):
        ours = model.embed_multimodal(modality, pixels, grid)
        expected = reference.model.visual(pixels, grid_thw=grid).pooler_output
        assert [o.shape[0] for o in ours] == [media.tokens(g) for g in grid]
        torch.testing.assert_close(torch.cat(ours), expected, rtol=1e-4, atol=1e-4)
    # The 84x112 image spans 2x2 windows of the windowed block: it is not one window.
    assert media.image_grid[1].tolist() == [1, 6, 8]


def _prompts(media):
    text = [5, 6, 7]
    image0, image1 = (media.placeholder("image", g) for g in media.image_grid)
    video = media.placeholder("video", media.video_grid[0])
    g_img, g_vid = media.image_grid, media.video_grid
    return {
        "text only": (text + [8, 9], {}),
        "one image": (text + image0 + [8, 9], dict(image_grid_thw=g_img[:1])),
        "two images": (text + image0 + [10] + image1 + [8], dict(image_grid_thw=g_img)),
        "image and video": (text + image1 + video + [8], dict(image_grid_thw=g_img[1:], video_grid_thw=g_vid)),
        "video with seconds": (text + video + [8, 9], dict(video_grid_thw=g_vid,
                                                           second_per_grid_ts=torch.tensor([1.5]))),
    }


@pytest.mark.parametrize("case", ["text only", "one image", "two images", "image and video", "video with seconds"])
def test_mrope_positions_match_get_rope_index(reference, media, case):
    from metrale.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as ours

    ids, grids = _prompts(media)[case]
    positions, delta = ours.mrope_positions(reference.config, ids, **grids)
    if case == "text only":
        expected, expected_delta = torch.arange(len(ids)).expand(3, -1), 0
    else:
        expected, expected_delta = reference.model.get_rope_index(torch.tensor([ids]), media.token_types(ids), **grids)
        expected, expected_delta = expected[:, 0], int(expected_delta)
    assert positions.dtype.name == "int64" and positions.shape == (3, len(ids))
    assert positions.tolist() == expected.tolist() and delta == expected_delta
    if "video" in case:  # the time row is spaced by tokens_per_second (2) * seconds per grid
        assert positions[0].max() > positions[1].max() - 3


def test_text_only_greedy_matches_transformers(checkpoint, llm, reference):
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in text_prompts()]
    assert greedy(llm, text_prompts()) == expected
    # 20 blocks of 4 = 80 slots for 98 tokens of requests: preempted and recomputed.
    small = LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=20, block_size=4, max_num_batched_tokens=32)
    assert greedy(small, text_prompts()) == expected
    assert small.llm_engine.scheduler.num_preemptions_total > 0


def test_images_and_video_through_forward_match_transformers(checkpoint, reference, media):
    """One request with two images and a video, prefilled in chunks of 16 that cut through them."""
    from metrale.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as ours

    image0, image1 = (media.placeholder("image", g) for g in media.image_grid)
    video = media.placeholder("video", media.video_grid[0])
    ids = [5, 6] + image0 + [7] + video + [8] + image1 + [9, 10]
    seconds = torch.tensor([1.0])
    expected = reference_greedy_vl(reference, ids, NEW_TOKENS, pixel_values=media.image_pixels,
                                   image_grid_thw=media.image_grid, pixel_values_videos=media.video_pixels,
                                   video_grid_thw=media.video_grid, second_per_grid_ts=seconds,
                                   mm_token_type_ids=media.token_types(ids))
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_num_batched_tokens=16)
    model = _model(llm)
    positions, delta = ours.mrope_positions(reference.config, ids, media.image_grid, media.video_grid,
                                            second_per_grid_ts=seconds)
    with torch.no_grad():
        images = model.embed_multimodal("image", media.image_pixels, media.image_grid)
        (clip,) = model.embed_multimodal("video", media.video_pixels, media.video_grid)
    embeds = torch.cat([images[0], clip, images[1]])  # in prompt order
    drive_multimodal(model, ids, positions, delta, embeds, {media.ids["<|image_pad|>"], media.ids["<|video_pad|>"]})
    assert greedy(llm, [ids]) == [expected]


def test_transformers_5_names_and_tied_embeddings_load(tmp_path, checkpoint, llm):
    """The checkpoint rewritten in transformers 5.x's layout (model.visual.*, model.language_model.*),
    or with a 4.x config.json, gives the same tokens; a tied checkpoint (no lm_head tensor) ties."""
    renamed = str(tmp_path / "v5")
    os.makedirs(renamed)
    for name in os.listdir(checkpoint):
        if name != "model.safetensors":
            os.symlink(os.path.join(checkpoint, name), os.path.join(renamed, name))
    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    v5 = {("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)): v
          for k, v in tensors.items()}
    assert any(k.startswith("model.visual.") for k in v5) and any(k.startswith("model.language_model.") for k in v5)
    save_file(v5, os.path.join(renamed, "model.safetensors"))
    assert greedy(LLM(renamed, dtype="float32", device="cpu"), text_prompts()) == greedy(llm, text_prompts())

    # The published checkpoints' 4.x config.json: text fields at the top, rope_scaling type "mrope".
    legacy = str(tmp_path / "v4_config")
    shutil.copytree(checkpoint, legacy)
    with open(os.path.join(legacy, "config.json")) as f:
        config = json.load(f)
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("layer_types", "model_type", "dtype"):
        text.pop(key, None)
    config.update(text, rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    config["vision_config"].pop("rope_parameters")
    with open(os.path.join(legacy, "config.json"), "w") as f:
        json.dump(config, f)
    assert greedy(LLM(legacy, dtype="float32", device="cpu"), text_prompts()) == greedy(llm, text_prompts())

    tied = make_vl_checkpoint(str(tmp_path / "tied"), "qwen2_5_vl", tie=True)
    import transformers

    reference = transformers.AutoModelForImageTextToText.from_pretrained(tied, dtype=torch.float32).eval()
    tied_llm = LLM(tied, dtype="float32", device="cpu")
    assert _model(tied_llm).tied_embeddings
    assert greedy(tied_llm, text_prompts()) == [reference_greedy(reference, p, NEW_TOKENS) for p in text_prompts()]


def test_tensor_parallel_text_only_matches_transformers(checkpoint, reference):
    """Two ranks: the text part sharded, the vision tower whole on each."""
    llm = LLM(checkpoint, dtype="float32", device="cpu", tp_size=2, master_port=free_port())
    try:
        assert llm.llm_engine.executor.world_size == 2
        expected = [reference_greedy(reference, p, NEW_TOKENS) for p in text_prompts()]
        assert greedy(llm, text_prompts()) == expected
    finally:
        llm.llm_engine.shutdown()


def test_bad_inputs_are_refused_by_name(llm, reference, media):
    from metrale.layers.vision.batch import MultiModalBatch
    from metrale.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as ours

    model = _model(llm)
    with pytest.raises(ValueError, match="modality 'audio'"):
        model.embed_multimodal("audio", media.image_pixels, media.image_grid)
    with pytest.raises(ValueError, match="pixel_values has"):
        model.embed_multimodal("image", media.image_pixels[:-4], media.image_grid)
    ids = [5] + media.placeholder("image", media.image_grid[0])
    with pytest.raises(ValueError, match="placeholder run"):
        ours.mrope_positions(reference.config, ids, media.image_grid[1:])
    with pytest.raises(ValueError, match="2 image grid"):
        ours.mrope_positions(reference.config, ids, media.image_grid)
    with pytest.raises(ValueError, match="do not match"):
        MultiModalBatch(torch.zeros(3, 64), torch.tensor([True, False])).check(2, 64)


def test_dummy_weights_cover_the_vision_tower(checkpoint, media):
    """`--load-format dummy` (benchmarks): every tensor of the whole model, the tower's too."""
    llm = LLM(checkpoint, dtype="float32", device="cpu", load_format="dummy")
    model = _model(llm)
    assert float(model.visual.patch_embed.proj.weight.abs().sum()) > 0
    with torch.no_grad():
        (rows,) = model.embed_multimodal("video", media.video_pixels, media.video_grid)
    assert rows.shape == (media.tokens(media.video_grid[0]), 64) and torch.isfinite(rows).all()
    assert len(greedy(llm, text_prompts())[2]) == NEW_TOKENS


def test_shipped_7b_config_builds_with_transformers_parameter_count():
    """metrale/model_configs/Qwen2.5-VL-7B-Instruct (the published 4.x config.json, for
    `--load-format dummy` runs): our model, built on the meta device, has transformers' number of
    parameters, the tower's included."""
    import transformers

    from metrale.config.model_config import load_model_config
    from metrale.executor.model_loader import construct_model
    from metrale.models.registry import supported_architectures
    from metrale.startup.model_source import SHIPPED_CONFIGS

    path = os.path.join(SHIPPED_CONFIGS, "Qwen2.5-VL-7B-Instruct")
    config = load_model_config(path, "bfloat16", torch.device("cpu"), 4096, supported_architectures())
    ours = construct_model(config, torch.device("meta"))
    with torch.device("meta"):
        reference = transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.from_pretrained(path))
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert count(ours.visual) == count(reference.model.visual) > 600_000_000
    assert count(ours) == count(reference)
