"""A checkpoint that cannot be used stops with an error that names the problem."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale import LLM
from metrale.config.model_config import ModelLoadError


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_unsupported_architecture_lists_supported(checkpoint_factory, tmp_path):
    path = copy_checkpoint(checkpoint_factory("llama"), tmp_path / "m")
    config = json.load(open(os.path.join(path, "config.json")))
    config["architectures"] = ["FancyNewForCausalLM"]
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ModelLoadError, match="FancyNewForCausalLM.*supported architectures: .*LlamaForCausalLM"):
        LLM(path, device="cpu")


def test_missing_tensor_is_named(checkpoint_factory, tmp_path):
    path = copy_checkpoint(checkpoint_factory("llama"), tmp_path / "m")
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model.layers.1.self_attn.qkv_proj.weight\[k\]"):
        LLM(path, device="cpu")


def test_wrong_shape_is_named(checkpoint_factory, tmp_path):
    path = copy_checkpoint(checkpoint_factory("llama"), tmp_path / "m")
    weights = load_file(os.path.join(path, "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        LLM(path, device="cpu")


def test_corrupt_file_is_named(checkpoint_factory, tmp_path):
    path = copy_checkpoint(checkpoint_factory("llama"), tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors.*corrupt or truncated"):
        LLM(path, device="cpu")


def test_pickle_checkpoints_are_refused(checkpoint_factory, tmp_path):
    path = copy_checkpoint(checkpoint_factory("llama"), tmp_path / "m")
    os.remove(os.path.join(path, "model.safetensors"))
    open(os.path.join(path, "pytorch_model.bin"), "wb").write(b"not loaded")
    with pytest.raises(ModelLoadError, match="pickle.*pytorch_model.bin"):
        LLM(path, device="cpu")


def test_sharded_checkpoint_loads_and_matches(checkpoint_factory, tmp_path):
    import transformers

    from metrale import SamplingParams

    src = checkpoint_factory("qwen3")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    dst = str(tmp_path / "sharded")
    model.save_pretrained(dst, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(src, name), dst)
    assert os.path.isfile(os.path.join(dst, "model.safetensors.index.json"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 4, 5, 6]}
    one = LLM(src, device="cpu").generate(prompt, params)[0].outputs[0].token_ids
    many = LLM(dst, device="cpu").generate(prompt, params)[0].outputs[0].token_ids
    assert one == many


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(tmp_path), device="cpu")


def test_dummy_weights_need_no_checkpoint(checkpoint_factory, tmp_path):
    from metrale import SamplingParams

    path = tmp_path / "config_only"
    path.mkdir()
    src = checkpoint_factory("qwen3")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), path)
    llm = LLM(str(path), device="cpu", load_format="dummy", num_kv_blocks=16)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_hf_overrides_replace_config_fields_and_bad_ones_are_refused(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    llm = LLM(path, device="cpu", load_format="dummy", num_kv_blocks=16, hf_overrides={"num_hidden_layers": 1})
    assert llm.llm_engine.model_config.num_layers == 1
    assert len(llm.llm_engine.runner.model.model.layers) == 1
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        LLM(path, device="cpu", hf_overrides="num_hidden_layers=1")
    with pytest.raises(ModelLoadError, match="hf_overrides: the Qwen3Config config has no field 'num_hiden_layers'"):
        LLM(path, device="cpu", hf_overrides='{"num_hiden_layers": 1}')


def test_auto_map_never_runs_remote_code(checkpoint_factory, tmp_path):
    """A repo asking for remote code (reliability case 19): code for a class other than the
    architecture met implements is refused, code for the very class met implements is ignored and
    met's own class loads it, an architecture only remote code would know is refused; no code runs."""
    path = copy_checkpoint(checkpoint_factory("llama"), tmp_path / "m")
    marker = tmp_path / "remote_code_ran"
    open(os.path.join(path, "modeling_evil.py"), "w").write(f"open({str(marker)!r}, 'w').write('x')\n")
    config = json.load(open(os.path.join(path, "config.json")))
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ModelLoadError, match="ships its own modeling code"):
        LLM(path, device="cpu", num_kv_blocks=8)
    config["auto_map"]["AutoModelForCausalLM"] = "modeling_evil.LlamaForCausalLM"
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    LLM(path, device="cpu", num_kv_blocks=8)
    config["architectures"] = ["Evil"]
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ModelLoadError, match="Evil"):
        LLM(path, device="cpu", num_kv_blocks=8)
    assert not marker.exists()


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "compressed-tensors", "something-new"])
def test_quantized_checkpoint_is_refused_naming_the_method(checkpoint_factory, tmp_path, method):
    path = copy_checkpoint(checkpoint_factory("llama"), tmp_path / "m")
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"] = {"quant_method": method, "weight_block_size": [128, 128]}
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ModelLoadError, match=f"quantized with '{method}'.*met loads these quantized formats: "
                                             f"fine-grained block FP8"):
        LLM(path, device="cpu", num_kv_blocks=8)


def test_a_tensor_nothing_consumes_is_an_error(checkpoint_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(checkpoint_factory("llama"), tmp_path / "m")
    weights_path = os.path.join(path, "model.safetensors")
    tensors = load_file(weights_path)
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, weights_path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="1 tensor.*o_proj.weight_scale_inv"):
        LLM(path, device="cpu", num_kv_blocks=8)
