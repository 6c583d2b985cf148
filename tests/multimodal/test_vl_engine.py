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


def other_image(seed: int = 3, size=(56, 84)) -> Image.Image:
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


@pytest.fixture(scope="module")
def cases(media, reference):
    """Three image prompts of different lengths and their transformers tokens."""
    a, b = tiny_images()
    c = other_image()
    prompts = [(image_prompt(media, "Hello, world!", " What is it?"), [a]),
               (image_prompt(media, "The quick brown fox jumps", " over the lazy dog.", count=2), [b, c]),
               (image_prompt(media, "Continuous batching", " lets many", count=1), [c])]
    return [({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
             hf_image_tokens(media, reference, ids, images)) for ids, images in prompts]


def run(llm, cases) -> list[list[int]]:
    outs = llm.generate([prompt for prompt, _ in cases], greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_chunked_prefill_splits_images_under_an_encoder_budget(checkpoint, cases):
    # Chunks of 5 tokens cut through every image; an encoder budget of 12 rows fits b (12) or
    # c and a, never all: some chunks stop before a placeholder and wait a step.
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_num_batched_tokens=5, max_num_encoder_tokens=12)
    assert run(llm, cases) == [expected for _, expected in cases]
    assert llm.llm_engine.runner.encoder_cache.num_computed_items == 3  # a, b, c once each


def test_preemption_recomputes_with_images(checkpoint, cases):
    llm = LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=14, block_size=4, max_num_batched_tokens=16)
    assert run(llm, cases) == [expected for _, expected in cases]
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


def test_prefix_hits_only_for_equal_images(checkpoint, media):
    a, _ = tiny_images()
    c = other_image(size=(56, 56))  # the same grid as a: the same token ids, other pixels
    ids = image_prompt(media, "A paged KV cache stores keys and values in", " fixed-size blocks. Hello, world!")
    offset = ids.index(media.ids["<|image_pad|>"])
    llm = LLM(checkpoint, dtype="float32", device="cpu", block_size=4)
    scheduler = llm.llm_engine.scheduler

    def hits(image) -> int:
        before = scheduler.kv.prefix_hits_total
        llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}], greedy(2), use_tqdm=False)
        return scheduler.kv.prefix_hits_total - before

    first = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": a}}], greedy(), use_tqdm=False)
    other = hits(c)
    assert 0 < other <= offset // 4 * 4  # the text before the image only
    same = hits(a)
    assert same >= offset + media.tokens((1, 4, 4))  # past the image
    # The encoder ran for a once (the second request with a took its cached output) and for c.
    assert llm.llm_engine.runner.encoder_cache.num_computed_items == 2
    again = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": a}}], greedy(), use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_refusals_by_name(checkpoint, checkpoint_factory, media):
    a, b = tiny_images()
    llm = LLM(checkpoint, dtype="float32", device="cpu", limit_mm_per_prompt={"image": 1})
    two = image_prompt(media, "Hello", " world", count=2)
    with pytest.raises(InvalidRequestError, match="limit-mm-per-prompt"):
        llm.generate([{"prompt_token_ids": two, "multi_modal_data": {"image": [a, b]}}], greedy(), use_tqdm=False)
    one = image_prompt(media, "Hello", " world")
    with pytest.raises(InvalidRequestError, match=r"2 image placeholder\(s\) but 1 image"):
        llm.generate([{"prompt_token_ids": one + two[-6:], "multi_modal_data": {"image": [a]}}], greedy(),
                     use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="unknown key.*'resize'"):
        llm.generate([{"prompt_token_ids": one, "multi_modal_data": {"image": a}, "mm_processor_kwargs": {"resize": 1}}],
                     greedy(), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="unknown modality 'audio'"):
        llm.generate([{"prompt_token_ids": one, "multi_modal_data": {"audio": a}}], greedy(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    text = LLM(checkpoint_factory("qwen2"), dtype="float32", device="cpu")
    with pytest.raises(InvalidRequestError, match="model Qwen2ForCausalLM does not take images"):
        text.generate([{"prompt": "Hello", "multi_modal_data": {"image": a}}], greedy(), use_tqdm=False)


def test_max_pixels_takes_effect(checkpoint, media, reference):
    _, b = tiny_images()  # 84 x 112: 12 tokens at the defaults
    ids = image_prompt(media, "Hello, world!", " What is it?")
    processor = media_processor(media)
    vision = processor(images=[b], return_tensors="pt", size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56})
    full = expanded(media, ids, vision["image_grid_thw"])
    expected = reference_greedy_vl(reference, full, NEW_TOKENS, pixel_values=vision["pixel_values"],
                                   image_grid_thw=vision["image_grid_thw"], mm_token_type_ids=media.token_types(full))
    llm = LLM(checkpoint, dtype="float32", device="cpu", vision_max_pixels=56 * 56)
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": b}}], greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected
    assert len(out.prompt_token_ids) == len(full) < len(ids) - 1 + 12  # fewer tokens than at the defaults


def test_video_and_image_batched_with_text(checkpoint, media, reference):
    from vl_checkpoints import video_pixel_values

    a, _ = tiny_images()
    frames = tiny_video()  # 4 frames: 2 temporal patches
    s, e = media.ids["<|vision_start|>"], media.ids["<|vision_end|>"]
    vpad, ipad = media.ids["<|video_pad|>"], media.ids["<|image_pad|>"]
    ids = text_ids(media, "Hello") + [s, ipad, e] + text_ids(media, " and") + [s, vpad, e] + text_ids(media, " what?")
    image = media_processor(media)(images=[a], return_tensors="pt")
    video_pixels, video_grid = video_pixel_values(media_processor(media), frames)
    full = []
    for t in ids:
        full += ([ipad] * media.tokens(image["image_grid_thw"][0]) if t == ipad else
                 [vpad] * media.tokens(video_grid[0]) if t == vpad else [t])
    # Numpy frames carry no rate: 2 fps is assumed, so one temporal patch of 2 frames spans 1 s.
    expected = reference_greedy_vl(reference, full, NEW_TOKENS, pixel_values=image["pixel_values"],
                                   image_grid_thw=image["image_grid_thw"], pixel_values_videos=video_pixels,
                                   video_grid_thw=video_grid, second_per_grid_ts=torch.tensor([1.0]),
                                   mm_token_type_ids=media.token_types(full))
    text = text_ids(media, "The quick brown fox")
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_num_batched_tokens=8)
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": a, "video": frames}},
                         {"prompt_token_ids": text}], greedy(), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected
    assert outs[1].outputs[0].token_ids == reference_greedy_vl(reference, text, NEW_TOKENS)


def test_tensor_parallel_images_match(checkpoint, cases):
    """Two ranks: the plan's media (pixels as bytes) crosses to the worker as msgpack, each rank
    runs the replicated tower, and the tokens are transformers'."""
    from parallel_cases import free_port

    llm = LLM(checkpoint, dtype="float32", device="cpu", tp_size=2, master_port=free_port(), max_num_batched_tokens=8)
    try:
        assert llm.llm_engine.executor.world_size == 2
        assert run(llm, cases) == [expected for _, expected in cases]
    finally:
        llm.close()


def test_async_engine_takes_images_and_refuses_by_name(checkpoint, cases):
    """The server's path: AsyncEngine.add_request with multi_modal_data; a refusal reaches the caller."""
    import asyncio

    from metrale.config.engine_args import EngineArgs
    from metrale.engine.async_engine import AsyncEngine
    from metrale.startup import build_llm_engine

    args = EngineArgs(model=checkpoint, dtype="float32", device="cpu", limit_mm_per_prompt={"image": 1})

    async def run():
        engine = AsyncEngine(lambda: build_llm_engine(args), max_waiting=8)
        engine.start()
        await engine.wait_until_loaded()
        try:
            prompt, expected = cases[0]
            tokens = []
            async for out in engine.generate("a", prompt, greedy()):
                tokens = list(out.outputs[0].token_ids)
            assert tokens == expected
            with pytest.raises(InvalidRequestError, match="limit-mm-per-prompt"):
                await engine.add_request("b", cases[1][0], greedy())
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_llm_chat_with_an_image_part(checkpoint, media, reference):
    """LLM.chat's content parts (the fetcher's path) reach the engine's processor: == transformers."""
    a, _ = tiny_images()
    rendered = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe it.<|im_end|>\n"
                "<|im_start|>assistant\n")
    expected = hf_image_tokens(media, reference, media.tokenizer.encode(rendered, add_special_tokens=False), [a])
    llm = LLM(checkpoint, dtype="float32", device="cpu")
    out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": a},
                                                 {"type": "text", "text": "Describe it."}]}], greedy(), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected
