"""The memory plan reserves the vision encoder's memory for the largest item allowed, before the
KV pool is sized; a text model reserves none."""

from __future__ import annotations

import pytest

from vl_checkpoints import make_vl_checkpoint

from metrale import LLM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_5_vl_plan")), "qwen2_5_vl")


def test_encoder_reserve_follows_max_pixels_and_comes_before_the_kv_pool(checkpoint, checkpoint_factory):
    full = LLM(checkpoint, dtype="float32", device="cpu").llm_engine.memory_plan
    small = LLM(checkpoint, dtype="float32", device="cpu", vision_max_pixels=56 * 56).llm_engine.memory_plan
    assert full.encoder_reserve_bytes > small.encoder_reserve_bytes > 0
    assert "50,176 pixels" in full.table() and "3,136 pixels" in small.table()
    # The budget left for the KV pool is what remains after the reserve.
    left = full.budget_bytes - full.weight_bytes - full.activation_reserve_bytes - full.encoder_reserve_bytes
    assert full.kv_cache_bytes <= left
    assert full.to_dict()["encoder_reserve_bytes"] == full.encoder_reserve_bytes
    text = LLM(checkpoint_factory("qwen2"), dtype="float32", device="cpu").llm_engine.memory_plan
    assert text.encoder_reserve_bytes == 0 and "encoder reserve" not in text.table()
