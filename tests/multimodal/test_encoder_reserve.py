"""The memory plan reserves the vision encoder's memory for the largest item allowed (an image of
the max pixels, or where videos are allowed a video of the encoder budget's tokens), before the
KV pool is sized; a text model reserves none."""

from __future__ import annotations

import pytest

from vl_checkpoints import make_vl_checkpoint

from metrale import LLM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_5_vl_plan")), "qwen2_5_vl")


IMAGES_ONLY = {"video": 0}


def test_encoder_reserve_follows_max_pixels_and_comes_before_the_kv_pool(checkpoint, checkpoint_factory):
    full = LLM(checkpoint, dtype="float32", device="cpu", limit_mm_per_prompt=IMAGES_ONLY).llm_engine.memory_plan
    small = LLM(checkpoint, dtype="float32", device="cpu", vision_max_pixels=56 * 56,
                limit_mm_per_prompt=IMAGES_ONLY).llm_engine.memory_plan
    assert full.encoder_reserve_bytes > small.encoder_reserve_bytes > 0
    assert "50,176 pixels" in full.table() and "3,136 pixels" in small.table()
    # The budget left for the KV pool is what remains after the reserve.
    left = full.budget_bytes - full.weight_bytes - full.activation_reserve_bytes - full.encoder_reserve_bytes
    assert full.kv_cache_bytes <= left
    assert full.to_dict()["encoder_reserve_bytes"] == full.encoder_reserve_bytes
    text = LLM(checkpoint_factory("qwen2"), dtype="float32", device="cpu").llm_engine.memory_plan
    assert text.encoder_reserve_bytes == 0 and "encoder reserve" not in text.table()


def test_with_videos_the_reserve_covers_a_video_of_the_encoder_budget(checkpoint):
    # The encoder budget admits one item of 96 tokens; an image is at most 64 (50,176 pixels),
    # a video of 96 tokens (96 x 28^2 pixels over its frames) is not refused, so it is reserved for.
    images = LLM(checkpoint, dtype="float32", device="cpu", max_num_encoder_tokens=96,
                 limit_mm_per_prompt=IMAGES_ONLY).llm_engine.memory_plan
    videos = LLM(checkpoint, dtype="float32", device="cpu", max_num_encoder_tokens=96).llm_engine.memory_plan
    assert "50,176 pixels" in images.table() and f"{96 * 28 * 28:,} pixels" in videos.table()
    assert videos.encoder_reserve_bytes > images.encoder_reserve_bytes
