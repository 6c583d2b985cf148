"""DeepSeek-V3 tiny end to end with the Triton MLA backend and with an fp8 latent cache.

The whole model under the Triton interpreter is minutes of MoE kernels, so the engine runs the
reference forward with its "mla" backend swapped for the Triton one (its kernels then run in the
interpreter on the CPU tensors): greedy tokens equal the PyTorch backend's over prefills, a
chunked extend, decodes and prefix hits. An fp8 latent cache takes one byte a value in the plan
(a quarter of this float32 model's, half of a bf16 one's); it computes exactly the model over e4m3-rounded latents (the same
log-probs as a float32 cache whose writes round through e4m3), in the Triton backend as in the
PyTorch one; it stays near the full-precision cache (a tiny random model's logits are nearly
flat, so e4m3's 3 mantissa bits move its log-probs by up to ~0.5); a checkpoint's k_scale
becomes the layer's latent scale."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

import metrale.layers.mla.torch_backend as torch_backend
from family_cases import family_fixtures
from metrale import LLM, SamplingParams
from metrale.layers.mla import MLAAttention
from metrale.layers.mla.triton_backend import TritonMLABackend
from mla_checkpoints import MLA_FAMILIES, make_mla_checkpoint

FP8 = torch.float8_e4m3fn

mla_checkpoint, _expected = family_fixtures(make_mla_checkpoint, "mla_checkpoint")


def _prompts():
    rng = random.Random(5)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 6, 45)]


def _engine(path, triton_mla=False, **kw):
    llm = LLM(path, dtype="float32", device="cpu", block_size=8, num_kv_blocks=64, **kw)
    if triton_mla:
        llm.llm_engine.runner.backends["mla"] = TritonMLABackend()
    return llm


def _generate(llm, max_tokens=4):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()], params,
                                               use_tqdm=False)]


def _first_logprobs(outputs):
    return [{token: lp.logprob for token, lp in o.logprobs[0].items()} for o in outputs]


def _mla_layers(llm):
    return [m for m in llm.llm_engine.runner.model.modules()
            if isinstance(m, MLAAttention) and m.latent_cache is not None]


@pytest.mark.parametrize("family", sorted(MLA_FAMILIES))  # interleaved rope and a low-rank q; neither
def test_triton_backend_tokens_equal_the_torch_backends(mla_checkpoint, family):
    path = mla_checkpoint(family)
    reference = [o.token_ids for o in _generate(_engine(path))]
    llm = _engine(path, triton_mla=True, max_num_batched_tokens=16)  # the 45-token prompt in chunks
    assert [o.token_ids for o in _generate(llm)] == reference
    hits = llm.llm_engine.scheduler.kv.prefix_hits_total
    assert [o.token_ids for o in _generate(llm)] == reference  # again, over cached prefixes
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > hits


def test_fp8_latent_cache_is_the_model_over_e4m3_latents_in_both_backends(mla_checkpoint, monkeypatch):
    path = mla_checkpoint("deepseek_v3")
    full = _first_logprobs(_generate(_engine(path), max_tokens=1))
    llm = _engine(path, kv_cache_dtype="fp8")
    assert all(cache.dtype == FP8 for cache in llm.llm_engine.runner.caches.paged)
    assert llm.llm_engine.memory_plan.kv_bytes_per_token == 3 * (32 + 16)  # float32 cache: 4x this
    fp8 = _first_logprobs(_generate(llm, max_tokens=1))
    triton_fp8 = _first_logprobs(_generate(_engine(path, triton_mla=True, kv_cache_dtype="fp8"), max_tokens=1))

    write = torch_backend.write_latent_reference

    def rounded_write(kv_c, k_pe, cache, slot_mapping, latent_scale=1.0):
        write(kv_c.to(FP8).float(), k_pe.to(FP8).float(), cache, slot_mapping)

    monkeypatch.setattr(torch_backend, "write_latent_reference", rounded_write)
    rounded = _first_logprobs(_generate(_engine(path), max_tokens=1))
    for f, t, r, x in zip(fp8, triton_fp8, rounded, full):
        assert f.keys() == r.keys() == t.keys()
        assert all(abs(f[k] - r[k]) < 1e-5 and abs(t[k] - f[k]) < 1e-4 for k in f)
        shared = f.keys() & x.keys()
        assert len(shared) >= 2 and all(abs(f[k] - x[k]) < 0.6 for k in shared)
    assert any(abs(f[k] - x[k]) > 1e-3 for f, x in zip(fp8, full) for k in f.keys() & x.keys())  # it did round


def test_checkpoint_k_scale_is_the_latent_scale(mla_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "scaled")
    shutil.copytree(mla_checkpoint("deepseek_v3"), path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    weights["model.layers.1.self_attn.k_scale"] = torch.tensor(0.25)
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor(0.125)  # one latent plane: dropped
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    llm = _engine(path, kv_cache_dtype="fp8")
    assert [layer.latent_scale for layer in _mla_layers(llm)] == [1.0, 0.25, 1.0]
    scaled = _first_logprobs(_generate(llm, max_tokens=1))
    unscaled = _first_logprobs(_generate(_engine(mla_checkpoint("deepseek_v3"), kv_cache_dtype="fp8"), max_tokens=1))
    assert scaled != unscaled  # layer 1's latents were stored on another grid
    assert all(layer.latent_scale == 1.0 for layer in _mla_layers(_engine(path)))  # no fp8 cache: no scale
