"""The cache layout of a hybrid model: K/V dtypes and checkpoint scales keyed by model layer
number (attention layer N is not the N-th attention layer), the recurrent state's dtype, the
post-load hook, and the memory plan of Qwen3-Next-80B-A3B against hand-computed numbers."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from hybrid_checkpoints import make_hybrid_checkpoint
from metrale import LLM
from metrale.config.engine_args import EngineArgs
from metrale.config.model_config import ModelLoadError, load_model_config
from metrale.distributed.launch import topology_from_args
from metrale.distributed.topology import TopologyError
from metrale.models.registry import supported_architectures
from metrale.startup.memory import plan_memory
from metrale.startup.model_source import resolve_model_dir
from metrale.startup.parallel import check_model_split, local_head_counts

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def next_ckpt(tmp_path_factory):
    return make_hybrid_checkpoint(str(tmp_path_factory.mktemp("next")), "qwen3_next")


def test_skip_layers_name_model_layers(next_ckpt):
    """Layers 1 and 3 are the attention layers; skipping layer 3 keeps that one in the model dtype."""
    llm = LLM(next_ckpt, device="cpu", num_kv_blocks=16, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="3")
    runner = llm.llm_engine.runner
    attention = {layer.layer_index: layer.cache_dtype for layer in runner.layers if hasattr(layer, "kv_cache")}
    assert attention == {1: FP8, 3: torch.float32}
    assert [c.dtype for c in runner.caches.paged] == [FP8, torch.float32]


def test_checkpoint_kv_scales_go_to_their_model_layer(next_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "scaled")
    shutil.copytree(next_ckpt, path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    save_file(dict(weights, **{"model.layers.3.self_attn.k_scale": torch.tensor(0.5)}),
              os.path.join(path, "model.safetensors"))
    llm = LLM(path, device="cpu", num_kv_blocks=16, kv_cache_dtype="fp8")
    scales = {layer.layer_index: layer.k_scale for layer in llm.llm_engine.runner.layers if hasattr(layer, "k_scale")}
    assert scales == {1: 1.0, 3: 0.5}
    save_file(dict(weights, **{"model.layers.2.self_attn.k_scale": torch.tensor(0.5)}),
              os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model layer 2 has no attention"):
        LLM(path, device="cpu", num_kv_blocks=16, kv_cache_dtype="fp8")


def test_recurrent_state_dtype_and_post_load_hook(next_ckpt):
    full = LLM(next_ckpt, device="cpu", num_kv_blocks=16)
    half = LLM(next_ckpt, device="cpu", num_kv_blocks=16, ssm_h_dtype="bfloat16")
    states = [c.dtype for c in half.llm_engine.runner.caches.states]
    assert states == [torch.float32, torch.bfloat16] * 2  # (conv in the model dtype, recurrent) per linear layer
    conv = 3 * 128 * 4  # kernel - 1 rows of the conv channels (2 x 32 + 64), float32
    recurrent = 4 * 16 * 16  # value heads x key dim x value dim
    assert full.llm_engine.memory_plan.state_bytes_per_slot == 2 * (conv + recurrent * 4)
    assert half.llm_engine.memory_plan.state_bytes_per_slot == 2 * (conv + recurrent * 2)
    gdn = full.llm_engine.runner.model.model.layers[0].linear_attn
    assert torch.equal(gdn.A, -gdn.A_log.float().exp())  # computed once, after loading


def test_memory_plan_of_qwen3_next_80b():
    args = EngineArgs(model="Qwen3-Next-80B-A3B-Instruct", load_format="dummy", max_model_len=32768,
                      max_num_seqs=64, hf_overrides={"num_hidden_layers": 24})
    config = load_model_config(resolve_model_dir(args.model, "dummy"), args.dtype, torch.device("cuda"),
                               args.max_model_len, supported_architectures(), args.config_overrides)
    plan = plan_memory(args, config, torch.device("cuda"), int(139.8 * 2**30))
    # 6 attention layers of the 24: K and V x 2 KV heads x 256 x bf16
    assert plan.kv_bytes_per_token == 6 * 2 * 2 * 256 * 2
    # 18 linear layers: a conv state (3 x (2 x 16 x 128 + 32 x 128) bf16) and a float32 state of 32 x 128 x 128
    assert plan.state_bytes_per_slot == 18 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    from metrale.executor.memory_plan import fit_kv_blocks

    fit_kv_blocks(plan)
    assert plan.max_num_seqs == 64 and plan.num_checkpoint_slots == 16
    assert plan.state_cache_bytes == (64 + 16 + 1) * plan.state_bytes_per_slot
    left = plan.budget_bytes - plan.weight_bytes - plan.activation_reserve_bytes - plan.runtime_overhead_bytes
    assert plan.num_kv_blocks == 64 * 32768 // 16  # capped at max_num_seqs full-length sequences...
    assert plan.state_cache_bytes + plan.kv_cache_bytes <= left  # ...within what is left after the state
    plan.requested_max_num_seqs = "auto"
    fit_kv_blocks(plan)  # as many sequences as fit, each with a quarter of the context and its state
    per_seq = 4096 * plan.kv_bytes_per_token + 1.25 * plan.state_bytes_per_slot  # a quarter of the context, at most 4096
    assert plan.max_num_seqs == int((left - plan.state_bytes_per_slot) // per_seq) // 8 * 8
    assert "gdn: 18 layer(s)" in plan.table() and "state slots" in plan.table()


def test_linear_attention_heads_that_do_not_divide_are_refused_by_name(next_ckpt):
    args = EngineArgs(model=next_ckpt, tp_size=4, hf_overrides={"linear_num_key_heads": 6,
                                                                "linear_num_value_heads": 12})
    config = load_model_config(next_ckpt, "auto", torch.device("cpu"), None, supported_architectures(),
                               args.config_overrides)
    topology, _ = topology_from_args(args)
    with pytest.raises(TopologyError, match="linear-attention key heads"):
        check_model_split(config, topology, "ep")
    config = load_model_config(next_ckpt, "auto", torch.device("cpu"), None, supported_architectures())
    assert local_head_counts(config, 2) == ("num_attention_heads=2, num_key_value_heads=1, "
                                            "linear_num_key_heads=1, linear_num_value_heads=2")
