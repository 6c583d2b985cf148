"""Qwen3-VL through the engine (DeepStack features, interleaved M-RoPE): images alone, two in a
prompt and batched with text, chunked through an image, preempted and recomputed, ==
transformers' generate in float32.
Videos (frame timestamps in the prompt): test_vl_video_qwen3.py."""

from __future__ import annotations

import pytest
import torch

from test_vl_engine import NEW_TOKENS, greedy, hf_image_tokens, image_prompt, other_image, text_ids
from vl_checkpoints import make_vl_checkpoint, tiny_images
from vl_reference import Media, reference_greedy_vl

from metrale import LLM

PREEMPTING_BLOCKS = 14  # of 4 tokens: every prompt fits alone, the three together do not


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_vl_checkpoint(str(tmp_path_factory.mktemp("qwen3_vl")), "qwen3_vl")


@pytest.fixture(scope="module")
def cases(checkpoint):
    """[(prompt, transformers' greedy tokens)]: one image, two images, text alone."""
    import transformers

    reference = transformers.Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    media = Media(checkpoint)
    a, b = tiny_images()
    c = other_image()
    one = image_prompt(media, "Hello, world!", " What is it?")
    two = image_prompt(media, "The quick brown fox", " jumps", count=2)
    text = text_ids(media, "A paged KV cache stores keys")
    return [({"prompt_token_ids": one, "multi_modal_data": {"image": a}}, hf_image_tokens(media, reference, one, [a])),
            ({"prompt_token_ids": two, "multi_modal_data": {"image": [b, c]}},
             hf_image_tokens(media, reference, two, [b, c])),
            ({"prompt_token_ids": text}, reference_greedy_vl(reference, text, NEW_TOKENS))]


def generate(llm, cases) -> list[list[int]]:
    outs = llm.generate([prompt for prompt, _ in cases], greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_qwen3_vl_images_batched_with_text(checkpoint, cases):
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_num_batched_tokens=7)
    assert generate(llm, cases) == [expected for _, expected in cases]


def test_qwen3_vl_preemption_recomputes_with_images(checkpoint, cases):
    llm = LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=PREEMPTING_BLOCKS, block_size=4,
              max_num_batched_tokens=16)
    assert generate(llm, cases) == [expected for _, expected in cases]
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
