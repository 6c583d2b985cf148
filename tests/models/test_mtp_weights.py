"""Multi-token-prediction (next-n) layers of DeepSeek-V3 and GLM-4.5 checkpoints (models/mtp.py):
loaded into `model.mtp`, equal to the checkpoint's tensors, hashed (sha256 over the stored tensors
in name order, each name then its raw bytes: recomputed here independently), the main forward
unchanged (greedy tokens of transformers, which ignores the layer; also over two tensor-parallel
CPU ranks), no cache for them in the plan, the weights' bytes grown by exactly theirs. A config that declares next-n layers over a
checkpoint without them loads as before, with no MTP; `--load-format dummy` draws the declared
layers (the checkpoint's shapes, the model's embedding and head); a layer held in part is refused,
naming what is missing.

The tiny checkpoints are tests/mla_checkpoints.py's DeepSeek-V3 (3 layers, MTP = layer 3, with its
own embed_tokens and shared_head.head, as DeepSeek stores them) and tests/moe_checkpoints.py's
GLM-4.5 (2 layers, MTP = layer 2, shared_head.head but no embed_tokens). The MTP decoder layer is
the last layer's tensors doubled, so a parameter loaded from the main layer instead shows.
"""

import hashlib
import logging
import os
import shutil

import pytest
import torch

from checkpoints import load_reference, reference_greedy
from metrale import LLM, SamplingParams
from metrale.config.engine_args import EngineArgs
from metrale.config.model_config import ModelLoadError, load_model_config
from metrale.executor.model_loader import build_model
from metrale.models.mtp import mtp_parameter_bytes
from metrale.models.registry import supported_architectures
from metrale.startup.memory import plan_memory
from mla_checkpoints import make_mla_checkpoint
from moe_checkpoints import make_moe_checkpoint
from test_generation_vs_hf import make_prompts

NEW_TOKENS = 6
# family -> (main layers, whether the MTP layer stores its own embed_tokens)
FAMILIES = {"deepseek_v3": (3, True), "glm4_moe": (2, False)}


def add_nextn_layer(source: str, path: str, layers: int, own_embedding: bool, drop: str | None = None) -> dict:
    """A copy of `source` with next-n layer `layers` (the last layer's tensors doubled, plus
    enorm, hnorm, eh_proj, shared_head, maybe embed_tokens); returns the MTP tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    last, mtp_prefix = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    generator = torch.Generator().manual_seed(7)
    hidden = weights["model.norm.weight"].shape[0]
    mtp = {name.replace(last, mtp_prefix): 2 * t for name, t in weights.items() if name.startswith(last)}
    mtp.update({
        f"{mtp_prefix}eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator) * 0.1,
        f"{mtp_prefix}enorm.weight": 1 + torch.randn(hidden, generator=generator) * 0.1,
        f"{mtp_prefix}hnorm.weight": 1 + torch.randn(hidden, generator=generator) * 0.1,
        f"{mtp_prefix}shared_head.norm.weight": 1 + torch.randn(hidden, generator=generator) * 0.1,
        f"{mtp_prefix}shared_head.head.weight": weights["lm_head.weight"] * 3})
    if own_embedding:
        mtp[f"{mtp_prefix}embed_tokens.weight"] = weights["model.embed_tokens.weight"] * 3
    if drop is not None:
        del mtp[mtp_prefix + drop]
    save_file({**weights, **mtp}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return mtp


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (base checkpoint, checkpoint with the next-n layer, its MTP tensors)."""
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"mtp_{family}")
            base = (make_mla_checkpoint(str(root / "base")) if family == "deepseek_v3"
                    else make_moe_checkpoint(str(root / "base"), "glm4_moe"))
            layers, own_embedding = FAMILIES[family]
            mtp = add_nextn_layer(base, str(root / "with_mtp"), layers, own_embedding)
            cache[family] = base, str(root / "with_mtp"), mtp
        return cache[family]

    return get


def _config(path):
    return load_model_config(path, "float32", torch.device("cpu"), None, supported_architectures())


def _build(path, load_format="auto"):
    return build_model(_config(path), torch.device("cpu"), load_format)


def _plan(path, load_format="auto"):
    args = EngineArgs(model=path, dtype="float32", load_format=load_format)
    return plan_memory(args, _config(path), torch.device("cpu"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mtp_parameters_equal_the_checkpoint_and_are_hashed(checkpoints, family, caplog):
    from safetensors import safe_open

    _, path, mtp = checkpoints(family)
    layers, own_embedding = FAMILIES[family]
    prefix = f"model.layers.{layers}."
    with caplog.at_level(logging.INFO):
        model = _build(path)
    assert len(model.mtp) == 1 and len(model.model.layers) == layers
    layer = model.mtp[0]
    for ours, theirs in (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
                         ("eh_proj.weight", "eh_proj.weight"), ("shared_head.norm.weight", "shared_head.norm.weight"),
                         ("shared_head.head.weight", "shared_head.head.weight")):
        assert torch.equal(layer.get_parameter(ours), mtp[prefix + theirs]), ours
    if own_embedding:
        assert torch.equal(layer.embed_tokens.weight, mtp[prefix + "embed_tokens.weight"])
    else:
        assert layer.embed_tokens is None  # the drafter will share the model's
    # The decoder layer: every parameter (stacked, per-expert, post-load derived) twice the main
    # last layer's, which loaded from the halves of the same tensors.
    main = dict(model.model.layers[layers - 1].named_parameters())
    block = dict(layer.block.named_parameters())
    assert block.keys() == main.keys()
    for name, param in block.items():
        assert torch.equal(param, 2 * main[name]), name
    # The hash, independently: the MTP tensors in name order, each name then its stored bytes.
    digest, count = hashlib.sha256(), 0
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as st:
        for name in sorted(n for n in st.keys() if n.startswith(prefix)):
            digest.update(name.encode())
            digest.update(st.get_tensor(name).contiguous().view(torch.uint8).numpy().tobytes())
            count += 1
    assert count == len(mtp)
    assert model.mtp_sha256 == digest.hexdigest() and model.mtp_tensor_count == count
    assert f"MTP: 1 layer(s), {count} tensors" in caplog.text and digest.hexdigest() in caplog.text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_main_forward_is_unchanged(checkpoints, family):
    base, path, _ = checkpoints(family)
    prompts = make_prompts()[:3]
    reference = load_reference(base)
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    llm = LLM(path, dtype="float32", device="cpu")
    try:
        runner = llm.llm_engine.runner
        assert runner.model.mtp_sha256 is not None
        assert [layer.layer_index for layer in runner.layers] == list(range(FAMILIES[family][0]))  # no MTP cache
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_tensor_parallel_ranks_load_the_mtp_layer(checkpoints):
    """Over two CPU ranks (the MTP decoder layer's heads and experts split as the main layers',
    eh_proj replicated): the tokens unchanged, the hash rank 0's."""
    from parallel_cases import free_port

    base, path, _ = checkpoints("deepseek_v3")
    prompts = make_prompts()[:2]
    reference = load_reference(base)
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    llm = LLM(path, dtype="float32", device="cpu", tp_size=2, master_port=free_port())
    try:
        assert llm.llm_engine.executor.world_size == 2
        assert llm.llm_engine.runner.model.mtp_sha256 == _build(path).mtp_sha256
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_declared_layers_without_tensors_load_as_before(checkpoints, family):
    base, path, _ = checkpoints(family)
    assert _config(base).hf_config.num_nextn_predict_layers == 1
    model = _build(base)
    assert not hasattr(model, "mtp") and model.mtp_sha256 is None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dummy_weights_hold_the_declared_layers(checkpoints, family):
    """--load-format dummy draws every declared next-n layer (tests/models/test_mtp_dummy.py runs
    them), shaped as the checkpoint's but with the model's embedding and head."""
    base, path, _ = checkpoints(family)
    real, dummy = _build(path), _build(base, load_format="dummy")
    assert len(dummy.mtp) == 1 and dummy.mtp_sha256 is not None and dummy.mtp_sha256 != real.mtp_sha256
    own = ("embed_tokens.", "shared_head.head.")
    shapes = {n: p.shape for n, p in real.mtp.named_parameters() if not n.startswith(tuple(f"0.{o}" for o in own))}
    assert {n: p.shape for n, p in dummy.mtp.named_parameters()} == shapes
    assert _plan(base, "dummy").weight_bytes == _plan(base).weight_bytes + mtp_parameter_bytes(dummy)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_memory_plan_grows_by_the_mtp_weights_only(checkpoints, family):
    base, path, _ = checkpoints(family)
    without, with_mtp = _plan(base), _plan(path)
    model = _build(path)
    assert mtp_parameter_bytes(model) > 0
    assert with_mtp.weight_bytes - without.weight_bytes == mtp_parameter_bytes(model)
    assert with_mtp.kv_bytes_per_token == without.kv_bytes_per_token
    assert with_mtp.cache_summary == without.cache_summary
    assert with_mtp.activation_reserve_bytes == without.activation_reserve_bytes


def test_a_layer_held_in_part_is_refused_by_name(checkpoints, tmp_path):
    base, _, _ = checkpoints("glm4_moe")
    path = str(tmp_path / "partial")
    add_nextn_layer(base, path, 2, False, drop="hnorm.weight")
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor\(s\) the model needs, e.g. mtp.0.hnorm.weight"):
        _build(path)
