"""Images and video through the engine (LLM.generate with multi_modal_data) on a tiny random
Qwen2.5-VL checkpoint: greedy tokens == transformers' generate in float32, alone and batched with
text, with chunked prefill through an image and with preemption; prefix hits only for equal
images; the encoder cache shared by two requests with one image; refusals by name.

The reference side builds its inputs itself: the checkpoint's image processor over the same PIL
images, each placeholder expanded by hand (tests/vl_reference.py), so the engine's processor,
placeholder expansion and M-RoPE positions are checked too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vl_checkpoints import make_vl_checkpoint, tiny_images, tiny_video
from vl_reference import Media, reference_greedy_vl

from metrale import LLM, SamplingParams
from metrale.messages.errors import InvalidRequestError

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_5_vl")), "qwen2_5_vl")


@pytest.fixture(scope="module")
def reference(checkpoint):
    import transformers

    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def media(checkpoint):
    return Media(checkpoint)


def text_ids(media, text: str) -> list[int]:
    return media.tokenizer.encode(text, add_special_tokens=False)


def image_prompt(media, before: str, after: str, count: int = 1) -> list[int]:
    """Token ids with `count` one-token image placeholders, as a chat template writes them."""
    s, e, pad = media.ids["<|vision_start|>"], media.ids["<|vision_end|>"], media.ids["<|image_pad|>"]
    ids = text_ids(media, before)
    for _ in range(count):
        ids += [s, pad, e]
    return ids + text_ids(media, after)


def expanded(media, ids: list[int], grids, kind: str = "image") -> list[int]:
    pad = media.ids[f"<|{kind}_pad|>"]
    out, grids = [], list(grids)
    for t in ids:
        out += [pad] * media.tokens(grids.pop(0)) if t == pad else [t]
    return out


def hf_image_tokens(media, reference, ids, images) -> list[int]:
    processor = media_processor(media)
    vision = processor(images=images, return_tensors="pt")
    full = expanded(media, ids, vision["image_grid_thw"])
    return reference_greedy_vl(reference, full, NEW_TOKENS, pixel_values=vision["pixel_values"],
                               image_grid_thw=vision["image_grid_thw"], mm_token_type_ids=media.token_types(full))


def media_processor(media):
    from transformers import AutoImageProcessor

    if not hasattr(media, "_processor"):
        media._processor = AutoImageProcessor.from_pretrained(media.tokenizer.name_or_path)
    return media._processor


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def other_image(seed: int = 5, size=(56, 84)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def test_images_alone_and_batched_with_text(checkpoint, reference, media):
    a, b = tiny_images()
    one = image_prompt(media, "Hello, world!", " What is it?")
    two = image_prompt(media, "The quick", " brown fox", count=2)
    text = text_ids(media, "A paged KV cache stores keys")
    expected = [hf_image_tokens(media, reference, one, [a]), hf_image_tokens(media, reference, two, [a, b]),
                reference_greedy_vl(reference, text, NEW_TOKENS)]
    llm = LLM(checkpoint, dtype="float32", device="cpu")
    prompts = [{"prompt_token_ids": one, "multi_modal_data": {"image": a}},
               {"prompt_token_ids": two, "multi_modal_data": {"image": [a, b]}},
               {"prompt_token_ids": text}]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # Both a and the repeated a are one content hash: the encoder ran for a and b only.
    assert llm.llm_engine.runner.encoder_cache.num_computed_items == 2
