"""The FP8 (e4m3) KV cache: scales, quantisation in both backends, and outputs close to a
full-precision cache under vLLM's check_logprobs_close rule."""

import os
import random
import shutil

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config.cache_config import CacheConfig
from metrale.config.engine_args import EngineArgs
from metrale.layers.forward_context import AttentionMetadata
from metrale.layers.attention.torch_backend import TorchAttentionBackend

FP8 = torch.float8_e4m3fn


def prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 40, 120, 250)]


def check_logprobs_close(a, b):
    """At the first divergence, each side's token is in the other's top logprobs."""
    for x, y in zip(a, b):
        for i, (tx, ty) in enumerate(zip(x.token_ids, y.token_ids)):
            if tx != ty:
                assert tx in y.logprobs[i] and ty in x.logprobs[i], (i, tx, ty)
                break


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp8_cache_is_close_to_full_precision(family, checkpoint_factory):
    path = checkpoint_factory(family)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)

    def run(**kw):
        llm = LLM(path, device="cpu", num_kv_blocks=128, **kw)
        return llm, [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts()], params)]

    _, full = run()
    llm, fp8 = run(kv_cache_dtype="fp8", fp8_kv_calibration_tokens=256)
    assert all(cache.dtype == FP8 for cache in llm.llm_engine.runner.caches.paged)
    layers = llm.llm_engine.runner.layers
    assert all(layer.k_scale != 1.0 and layer.v_scale != 1.0 for layer in layers)  # calibrated
    check_logprobs_close(full, fp8)
    assert any(x.token_ids[0] == y.token_ids[0] for x, y in zip(full, fp8))


def test_pool_holds_twice_the_tokens_for_the_same_bytes(checkpoint_factory):
    path = checkpoint_factory("llama")
    budget = 4 << 20
    full = LLM(path, device="cpu", dtype="bfloat16", kv_cache_memory=budget, max_num_seqs=64)
    fp8 = LLM(path, device="cpu", dtype="bfloat16", kv_cache_memory=budget, kv_cache_dtype="fp8", max_num_seqs=64)
    assert fp8.llm_engine.memory_plan.kv_capacity_tokens == 2 * full.llm_engine.memory_plan.kv_capacity_tokens


def test_skip_layers_stay_in_model_dtype(checkpoint_factory):
    llm = LLM(checkpoint_factory("llama"), device="cpu", num_kv_blocks=16, kv_cache_dtype="fp8",
              kv_cache_dtype_skip_layers="1")
    dtypes = [cache.dtype for cache in llm.llm_engine.runner.caches.paged]
    assert dtypes == [FP8, torch.float32]
    config = CacheConfig.from_args(EngineArgs(kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="1"), torch.bfloat16)
    assert config.kv_dtype(0) == FP8
    assert config.kv_dtype(1) == torch.bfloat16
    with pytest.raises(ValueError, match="layer indices"):
        EngineArgs(kv_cache_dtype_skip_layers="a,b")


def test_checkpoint_scales_are_used(checkpoint_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "scaled")
    shutil.copytree(checkpoint_factory("llama"), path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(weights, os.path.join(path, "model.safetensors"))
    llm = LLM(path, device="cpu", num_kv_blocks=16, kv_cache_dtype="fp8", fp8_kv_calibration_tokens=100)
    layers = llm.llm_engine.runner.layers
    assert (layers[0].k_scale, layers[1].v_scale) == (0.5, 0.25)  # not recalibrated
    plain = LLM(path, device="cpu", num_kv_blocks=16)  # a full-precision cache ignores them
    assert all(layer.k_scale == 1.0 for layer in plain.llm_engine.runner.layers)


def test_reference_backend_quantises_with_scale_and_saturates():
    backend = TorchAttentionBackend()
    k_cache = torch.zeros(2, 4, 1, 8, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    k = torch.full((2, 1, 8), 3.0)
    k[1] = 1e6  # saturates to 448 * scale instead of becoming inf or NaN
    backend.write_kv(k, k.clone(), k_cache, v_cache, torch.tensor([0, 5]), k_scale=2.0, v_scale=2.0)
    assert k_cache[0, 0].float().unique().tolist() == [1.5]
    assert k_cache[1, 1].float().unique().tolist() == [448.0]
    metadata = AttentionMetadata(torch.tensor([0]), torch.tensor([[0, 1]], dtype=torch.int32),
                                 torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                                 1, 1, [1], [1])
    out = backend.forward(torch.ones(1, 1, 8), k_cache, v_cache, metadata, 1.0, k_scale=2.0, v_scale=2.0)
    assert torch.allclose(out, torch.full((1, 1, 8), 3.0))  # one key: the output is its value, 1.5 x 2
