"""benchmarks/vl_bench.py: its floor arithmetic, and its CPU smoke run (--tiny), where met and
transformers load the same tiny checkpoint and must give the same greedy tokens with images."""

import json
import os
import sys
from types import SimpleNamespace

import pytest

from metrale.bench.hardware import HardwareRates
from metrale.bench.vision_floor import VLWeights, batch_floor, kv_bytes_per_token, qwen2_5_vision_flops, ttft_floor
from metrale.bench.vl_workload import VisionTokens, make_requests, prompt_ids

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

VISION = SimpleNamespace(hidden_size=32, intermediate_size=64, depth=2, spatial_merge_size=2, in_channels=3,
                         temporal_patch_size=2, patch_size=14, out_hidden_size=64, window_size=56,
                         fullatt_block_indexes=[0])
TEXT = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64)


def test_vision_flops_by_hand():
    """A 1x4x8 grid: 32 patches, merged 2x4 units; windows of 2x2 units (56 px): two of 16 patches."""
    d, inner, patches = 32, 64, 32
    linear = patches * (3 * 2 * 14 * 14 * d + 2 * (4 * d * d + 3 * d * inner))
    linear += 8 * (128 * 128 + 128 * 64)  # the merger on 8 merged rows of 4 * 32
    attention = 2 * d * (32 * 32 + 2 * 16 * 16)  # block 0 over the frame, block 1 over its two windows
    assert qwen2_5_vision_flops(VISION, [[1, 4, 8]]) == 2 * linear + 2 * attention


def test_vision_flops_refuse_another_tower():
    with pytest.raises(ValueError, match="fullatt_block_indexes"):
        qwen2_5_vision_flops(SimpleNamespace(hidden_size=32), [[1, 4, 4]])


def test_floors_add_tower_prefill_and_decode():
    rates = HardwareRates("test", 1e12, 1e14)
    weights = VLWeights(vision_params=10, vision_bytes=20, text_params=1000, text_bytes=2000, lm_head_params=100)
    vision = qwen2_5_vision_flops(VISION, [[1, 4, 4]])
    ttft = ttft_floor(weights, TEXT, VISION, [[1, 4, 4]], 10, rates)
    assert ttft.bytes_moved == 2020
    assert ttft.flops == vision + 2 * 900 * 10 + 2 * 100 + 4 * 2 * 64 * 55  # the LM head on the last token only
    batch = batch_floor(weights, TEXT, VISION, [[1, 4, 4]] * 2, [10, 10], 3, rates)
    kv = kv_bytes_per_token(TEXT)
    assert kv == 2 * 2 * 2 * 16 * 2
    # Two decode steps read the text weights again and contexts 11, 12 for each request.
    assert batch.bytes_moved == 20 + 2000 * 3 + kv * (20 + 2 * (11 + 12))
    assert batch.flops == (2 * vision + 2 * 900 * 20 + 2 * 100 * 2 + 4 * 2 * 64 * 110
                           + 2 * 1000 * 4 + 4 * 2 * 64 * 2 * (11 + 12))


def test_prompts_lay_out_each_image_and_differ_per_request():
    tokens = VisionTokens(image_pad=9, vision_start=7, vision_end=8, text_id_limit=7)
    ids = prompt_ids(tokens, [4, 4], seed=0)
    assert ids.count(9) == 8 and ids.count(7) == 2 and ids.count(8) == 2
    first = ids.index(7)
    assert ids[first:first + 6] == [7, 9, 9, 9, 9, 8]
    a, b = make_requests(tokens, 2, 1, 28, 1, seed=0)
    assert a.prompt_token_ids != b.prompt_token_ids and a.images[0].tobytes() != b.images[0].tobytes()
    again = make_requests(tokens, 1, 1, 28, 1, seed=0)[0]
    assert again.prompt_token_ids == a.prompt_token_ids and again.images[0].tobytes() == a.images[0].tobytes()


def test_tiny_run_gives_transformers_tokens(tmp_path):
    import vl_bench

    out = tmp_path / "vl.json"
    result = vl_bench.run(vl_bench.parse_args(["--tiny", "--output-json", str(out)]))
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [c["images_per_request"] for c in result["cases"]] == [1, 2]
    for case in result["cases"]:
        assert case["tokens_equal"], case
        assert case["prompt_len"] == 64 + case["images_per_request"] * (4 + 2)
        for name in ("met", "transformers"):
            run = case[name]
            assert len(run["ttft_per_iter_s"]) == 3 and run["ttft_p99_s"] >= run["ttft_median_s"] > 0
            assert run["output_tokens"] == 2 * 4 and run["batch_seconds"] > 0
        assert 0 < case["floor_ttft_s"] < case["met"]["ttft_median_s"]
        assert 0 < case["floor_batch_s"] < case["met"]["batch_seconds"]


def test_met_gets_one_placeholder_per_image():
    tokens = VisionTokens(image_pad=9, vision_start=7, vision_end=8, text_id_limit=7)
    (request,) = make_requests(tokens, 1, 2, 28, 3, seed=0)
    met = request.met_prompt()
    assert request.prompt_token_ids.count(9) == 6 and met["prompt_token_ids"].count(9) == 2
    assert [t for t in request.prompt_token_ids if t != 9] == [t for t in met["prompt_token_ids"] if t != 9]
    assert met["multi_modal_data"]["image"] == request.images


def test_shipped_7b_prompt_is_what_mets_processor_expands():
    """The GPU run's inputs, offline: the shipped preprocessor config turns a 1024x1024 image into
    74x74 patches (1369 tokens), and met's processor expands the one-placeholder prompt to exactly
    the ids transformers is given."""
    import transformers

    import vl_bench
    from metrale.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from metrale.multimodal.processor import MultiModalProcessor

    args = vl_bench.parse_args(["--num-iters", "1", "--batch-size", "1", "--images-per-request", "2"])
    cases, (config, grid) = vl_bench._cases(args, vl_bench.SHIPPED)
    assert grid == [1, 74, 74] and cases[0].tokens_per_image == 1369 and cases[0].prompt_len == 64 + 2 * 1371
    request = cases[0].batch_requests[0]
    processor = MultiModalProcessor(vl_bench.SHIPPED, Qwen2_5_VLForConditionalGeneration,
                                    transformers.AutoConfig.from_pretrained(vl_bench.SHIPPED))
    prompt = request.met_prompt()
    processed = processor.process(prompt["prompt_token_ids"], prompt["multi_modal_data"], None)
    assert processed.token_ids == request.prompt_token_ids
    assert [item.grid_thw for item in processed.items] == [(1, 74, 74)] * 2
