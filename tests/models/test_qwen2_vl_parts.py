"""Qwen2-VL against transformers, float32, on a tiny random checkpoint with the tests' two images
and 4-frame video: the vision tower == `model.visual`; positions == `get_rope_index` (2 images +
a video: time steps by one per temporal patch); text-only greedy == transformers; an image +
video prompt through `forward(multimodal=...)` in chunks of 16 == `generate`."""

import random

import torch

from checkpoints import reference_greedy
from vl_checkpoints import make_vl_checkpoint
from vl_reference import Media, drive_multimodal, reference_greedy_vl

from metrale import LLM, SamplingParams

NEW_TOKENS = 6


def greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_qwen2_vl_matches_transformers(tmp_path):
    import transformers

    path = make_vl_checkpoint(str(tmp_path / "qwen2_vl"), "qwen2_vl")
    reference = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    media = Media(path)
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    with torch.no_grad():
        images = model.embed_multimodal("image", media.image_pixels, media.image_grid)
        (clip,) = model.embed_multimodal("video", media.video_pixels, media.video_grid)
        for ours, pixels, grid in ((torch.cat(images), media.image_pixels, media.image_grid),
                                   (clip, media.video_pixels, media.video_grid)):
            torch.testing.assert_close(ours, reference.model.visual(pixels, grid_thw=grid).pooler_output,
                                       rtol=1e-4, atol=1e-4)

    image0, image1 = (media.placeholder("image", g) for g in media.image_grid)
    ids = [5, 6] + image0 + [7] + media.placeholder("video", media.video_grid[0]) + [8] + image1 + [9, 10]
    positions, delta = model.mrope_positions(model.vl_config, ids, media.image_grid, media.video_grid)
    expected, expected_delta = reference.model.get_rope_index(torch.tensor([ids]), media.token_types(ids),
                                                              image_grid_thw=media.image_grid,
                                                              video_grid_thw=media.video_grid)
    assert positions.tolist() == expected[:, 0].tolist() and delta == int(expected_delta)

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 9, 40)]
    assert greedy(llm, prompts) == [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]

    expected_tokens = reference_greedy_vl(reference, ids, NEW_TOKENS, pixel_values=media.image_pixels,
                                          image_grid_thw=media.image_grid, pixel_values_videos=media.video_pixels,
                                          video_grid_thw=media.video_grid, mm_token_type_ids=media.token_types(ids))
    drive_multimodal(model, ids, positions, delta, torch.cat([images[0], clip, images[1]]),
                     {media.ids["<|image_pad|>"], media.ids["<|video_pad|>"]})
    assert greedy(llm, [ids]) == [expected_tokens]
