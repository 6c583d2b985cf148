"""What an FP8 checkpoint must be, and the quantized formats met refuses: each an error before any
generation, naming what is wrong. Plus online FP8, dummy FP8 weights and the shipped FP8 configs."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import load_reference, make_checkpoint, reference_greedy
from fp8_checkpoints import quantize_checkpoint
from metrale import LLM, SamplingParams
from metrale.config.model_config import ModelLoadError
from metrale.distributed.topology import TopologyError
from metrale.config.quantization import QuantizationError, resolve_quantization
from metrale.kernels.fp8_math import dequantize_weight, quantize_weight
from metrale.layers.quantization.scales import compress_rows

PROMPTS = [[5, 17, 33, 2, 9, 100], [7] * 13, [200]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("src")), "qwen3", hidden_size=80, intermediate_size=144)


@pytest.fixture(scope="module")
def fp8(source, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return quantize_checkpoint(source, str(root / "fp8"), str(root / "ref"), (32, 32))[0]


def _edited(path: str, dst, tensors=None, quantization=None) -> str:
    shutil.copytree(path, dst)
    if tensors is not None:
        weights = os.path.join(dst, "model.safetensors")
        save_file(tensors(load_file(weights)), weights, metadata={"format": "pt"})
    if quantization is not None:
        config_path = os.path.join(dst, "config.json")
        config = json.load(open(config_path))
        config["quantization_config"] = quantization(config["quantization_config"])
        json.dump(config, open(config_path, "w"))
    return str(dst)


def _without(name):
    return lambda tensors: {k: v for k, v in tensors.items() if k != name}


@pytest.mark.parametrize("quantization, message", [
    (lambda q: {**q, "quant_method": "awq"}, "quantized with 'awq'"),
    (lambda q: {k: v for k, v in q.items() if k != "weight_block_size"}, "per-tensor FP8"),
    (lambda q: {**q, "activation_scheme": "static"}, "static activation scales"),
    (lambda q: {**q, "fmt": "e5m2"}, "'e5m2' is not supported"),
    (lambda q: {**q, "weight_block_size": [128]}, "is not two positive integers"),
])
def test_unsupported_fp8_variants_are_refused(fp8, tmp_path, quantization, message):
    with pytest.raises(QuantizationError, match=message):
        LLM(_edited(fp8, tmp_path / "m", quantization=quantization), device="cpu", num_kv_blocks=8)


@pytest.mark.parametrize("edit, message", [
    (_without("model.layers.0.self_attn.k_proj.weight_scale_inv"),
     r"FP8 weight\(s\) model.layers.0.self_attn.k_proj.weight have no scale tensor: "
     r"model.layers.0.self_attn.k_proj.weight_scale_inv missing"),
    (_without("model.layers.1.mlp.up_proj.weight"),
     r"scale\(s\) model.layers.1.mlp.up_proj.weight_scale_inv without their FP8 weights"),
    (lambda t: {**t, "model.layers.0.mlp.down_proj.weight": t["model.layers.0.mlp.down_proj.weight"].float()},
     "down_proj.weight: it is torch.float32, but the quantization_config makes this layer FP8"),
    (lambda t: {**t, "model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(2, 2)},
     r"o_proj.weight_scale_inv: scale shape \(2, 2\) does not match the \[80, 128\] weight's \[32, 32\] blocks \(3, 4\)"),
    (lambda t: {**t, "model.embed_tokens.weight_scale_inv": torch.ones(1, 1)},
     r"1 tensor\(s\) that no parameter .* takes, e.g. model.embed_tokens.weight_scale_inv"),
])
def test_broken_fp8_checkpoints_are_refused_naming_the_tensor(fp8, tmp_path, edit, message):
    with pytest.raises(ModelLoadError, match=message):
        LLM(_edited(fp8, tmp_path / "m", tensors=edit), device="cpu", num_kv_blocks=8)


def test_fp8_router_weights_are_refused(tmp_path):
    """Routers stay in the model dtype; a checkpoint that quantized one is refused by name."""
    from moe_checkpoints import make_moe_checkpoint

    src = make_moe_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    fp8, _ = quantize_checkpoint(src, str(tmp_path / "fp8"), str(tmp_path / "ref"), (32, 32))
    weights = os.path.join(fp8, "model.safetensors")
    tensors = load_file(weights)
    gate, scale = quantize_weight(tensors["model.layers.0.mlp.gate.weight"], 32, 32)
    tensors.update({"model.layers.0.mlp.gate.weight": gate, "model.layers.0.mlp.gate.weight_scale_inv": scale})
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="mlp.gate.weight: the checkpoint stores it in FP8, but met keeps this "
                                             "layer unquantized"):
        LLM(fp8, device="cpu", num_kv_blocks=8)


def test_quantization_options_are_checked():
    with pytest.raises(ValueError, match="quantization 'awq' is not supported"):
        LLM("demo", device="cpu", quantization="awq")
    with pytest.raises(QuantizationError, match="--quantization 'int8' is not supported; supported: fp8"):
        resolve_quantization({"quant_method": "fp8", "weight_block_size": [128, 128]}, "int8", "dynamic", "m")
    online = resolve_quantization(None, "fp8", "none", "m")
    assert (online.online, online.block_n, online.block_k, online.activation_group) == (True, 1, 128, None)


def test_skips_matches_whole_name_components():
    config = resolve_quantization({"quant_method": "fp8", "weight_block_size": [128, 128],
                                   "modules_to_not_convert": ["lm_head", "mlp.gate", "model.layers.3"]},
                                  None, "dynamic", "m")
    assert config.skips("lm_head") and config.skips("model.layers.0.mlp.gate")
    assert config.skips("model.layers.3.self_attn.q_proj")
    assert not config.skips("model.layers.0.mlp.gate_proj") and not config.skips("model.layers.30.mlp.down_proj")


def test_scales_compress_to_blocks_only_when_every_block_shares_one():
    rows = torch.arange(3.0).repeat_interleave(4)[:10, None].expand(10, 2)  # blocks of 4 rows, partial last
    compressed, group = compress_rows(rows.contiguous(), 4)
    assert group == 4 and compressed[:, 0].tolist() == [0.0, 1.0, 2.0]
    mixed = rows.clone()
    mixed[5] = 9.0
    assert compress_rows(mixed, 4)[1] == 1


def test_online_fp8_matches_transformers_on_the_same_quantization(source, tmp_path):
    """--quantization fp8 on a float32 checkpoint: each projection quantized per output row in
    groups of 128 inputs as it loads; without activation quantization, transformers on those
    weights dequantized gives the same tokens."""
    reference_dir = _edited(source, tmp_path / "ref", tensors=lambda t: {
        k: dequantize_weight(*quantize_weight(v, 1, 128), 1, 128) if _is_projection(k, v) else v
        for k, v in t.items()})
    reference = load_reference(reference_dir)
    expected = [reference_greedy(reference, p, 8) for p in PROMPTS]
    llm = LLM(source, dtype="float32", device="cpu", quantization="fp8", activation_quantization="none",
              num_kv_blocks=32)
    assert llm.llm_engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    assert got == expected


def _is_projection(name, tensor):
    from fp8_checkpoints import is_projection

    return is_projection(name, tensor)


def test_dummy_weights_of_a_quantized_config_are_fp8(fp8):
    llm = LLM(fp8, dtype="float32", device="cpu", load_format="dummy", num_kv_blocks=16)
    layer = llm.llm_engine.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.self_attn.qkv_proj.weight_scale_inv.shape == (8, 3)  # 256 rows / 32, ceil(80 / 32)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
    assert len(out[0].outputs[0].token_ids) == 8


def test_a_tp_split_through_an_input_block_is_refused_with_the_sizes_that_work(fp8, tmp_path):
    """tp=2 halves o_proj's 128 inputs into 64 (two whole 32-blocks): fine; a [48, 48] block
    does not divide 64, so the same split is refused, naming the tp sizes that keep blocks whole."""
    from metrale.layers.quantization.apply import working_tp_sizes

    assert working_tp_sizes(128, 48) == [1]
    assert working_tp_sizes(144, 48) == [1, 3]
    assert working_tp_sizes(4096, 128) == [1, 2, 4, 8, 16]
    path = _edited(fp8, tmp_path / "m", quantization=lambda q: {**q, "weight_block_size": [48, 48]},
                   tensors=lambda t: _requantized(t, 48))
    with pytest.raises(TopologyError, match=r"o_proj: its 128 input features split over 2 ranks into 64 per rank, "
                                            r"which cuts the 48-wide groups its FP8 scales cover; tp sizes that "
                                            r"keep them whole: 1"):
        LLM(path, device="cpu", tp_size=2, num_kv_blocks=8)


def _requantized(tensors, block):
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            weight = dequantize_weight(tensor, tensors[f"{name}_scale_inv"], 32, 32)
            out[name], out[f"{name}_scale_inv"] = quantize_weight(weight, block, block)
        else:
            out[name] = tensor
    return out


@pytest.mark.parametrize("name", ["Qwen3-8B-FP8", "Qwen3-30B-A3B-FP8", "Qwen3-Next-80B-A3B-Instruct-FP8"])
def test_shipped_fp8_configs_plan_in_fp8(name):
    """The shipped FP8 configs on the meta device: about half their bf16 weight bytes (the LM
    head, embeddings, routers and listed modules stay bf16), and the 80B hybrid fits one H200."""
    from metrale.config.engine_args import EngineArgs
    from metrale.startup.memory import plan_memory
    from metrale.startup.model_source import read_model_config

    def plan(model):
        args = EngineArgs(model=model, load_format="dummy", skip_tokenizer_init=True, max_model_len=32768)
        return plan_memory(args, read_model_config(args, torch.device("cuda")), torch.device("cuda"),
                           device_total=int(139.8 * 2**30))

    fp8_plan, bf16_plan = plan(name), plan(name.removesuffix("-FP8"))
    assert 0.5 < fp8_plan.weight_bytes / bf16_plan.weight_bytes < 0.6
    assert "fp8 e4m3 weights ([128, 128] blocks)" in fp8_plan.table()
    if name.startswith("Qwen3-Next"):
        assert fp8_plan.weight_bytes < 80 * 2**30 < bf16_plan.weight_bytes
