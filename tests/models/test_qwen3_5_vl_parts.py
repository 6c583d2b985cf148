"""Qwen3.5's vision-language models against transformers, float32, on tiny random checkpoints
(layer 0 Gated DeltaNet, layer 1 gated attention with M-RoPE on half of each head; the Qwen3-VL
tower without DeepStack), with the tests' two images and 4-frame video:

- the vision tower == `model.visual`; positions == `get_rope_index` (image + video frames);
- text-only greedy through `LLM` (batched, chunked) == transformers;
- an image + video prompt through `forward(multimodal=...)` in chunks of 16 == `generate`
  (the Gated DeltaNet state carried across the chunks);
- the MoE variant likewise.
"""

import random

import pytest
import torch

from checkpoints import reference_greedy
from vl_checkpoints import make_vl_checkpoint
from vl_reference import Media, drive_multimodal, reference_greedy_vl

from metrale import LLM, SamplingParams

NEW_TOKENS = 6


def _reference(path):
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["qwen3_5_vl", "qwen3_5_moe_vl"])
def case(request, tmp_path_factory):
    path = make_vl_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param)
    return path, _reference(path), Media(path)


def text_prompts():
    rng = random.Random(2)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 9, 40)]


def greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_tower_positions_text_and_images_match_transformers(case):
    path, reference, media = case
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    with torch.no_grad():
        images = model.embed_multimodal("image", media.image_pixels, media.image_grid)
        (clip,) = model.embed_multimodal("video", media.video_pixels, media.video_grid)
        expected_rows = reference.model.visual(media.image_pixels, grid_thw=media.image_grid).pooler_output
    torch.testing.assert_close(torch.cat(images), expected_rows, rtol=1e-4, atol=1e-4)

    image0, image1 = (media.placeholder("image", g) for g in media.image_grid)
    video = media.placeholder("video", media.video_grid[0], frames_as_items=True)
    ids = [5, 6] + image0 + [7] + video + [8] + image1 + [9, 10]
    positions, delta = model.mrope_positions(model.vl_config, ids, media.image_grid, media.video_grid)
    expected, expected_delta = reference.model.get_rope_index(
        torch.tensor([ids]), media.token_types(ids), image_grid_thw=media.image_grid,
        video_grid_thw=media.video_grid.clone())
    assert positions.tolist() == expected[:, 0].tolist() and delta == int(expected_delta)

    assert greedy(llm, text_prompts()) == [reference_greedy(reference, p, NEW_TOKENS) for p in text_prompts()]

    expected_tokens = reference_greedy_vl(reference, ids, NEW_TOKENS, pixel_values=media.image_pixels,
                                          image_grid_thw=media.image_grid, pixel_values_videos=media.video_pixels,
                                          video_grid_thw=media.video_grid.clone(),
                                          mm_token_type_ids=media.token_types(ids))
    embeds = torch.cat([images[0], clip, images[1]])
    drive_multimodal(model, ids, positions, delta, embeds, {media.ids["<|image_pad|>"], media.ids["<|video_pad|>"]})
    assert greedy(llm, [ids]) == [expected_tokens]
