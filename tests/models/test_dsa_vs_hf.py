"""DeepSeek-V3.2 and GLM-5 (DSA: MLA attending over a lightning indexer's top-k selection):
greedy token ids identical to transformers, float32, on tiny random checkpoints
(tests/dsa_checkpoints.py: index_topk 24, so every prompt of 25+ tokens attends sparsely; GLM-5
with full and shared indexer layers).

As test_mla_vs_hf.py: seven prompts of lengths 1..250 together, then again on the same engine
with prefix hits; every prompt chunked by a 16-token step budget (a chunk's rows select over the
cached prefix and the chunk); a KV pool so small that requests are preempted and recomputed;
two CPU ranks. Plus: the selections of a run really drop positions and have no ties at the
top-k boundary (the premise of comparing tokens exactly); the FP8 indexer cache end to end and
its selections against bfloat16's; the memory plan's indexer bytes; the refusals (fp8 without
an indexer, GLM-5 options met does not run).
"""

import json
import os
import shutil

import pytest
import torch

from dsa_checkpoints import DEEPSEEK_V32, DSA_FAMILIES, INDEX_TOPK, make_dsa_checkpoint
from family_cases import assert_idle, family_fixtures, generate_twice
from metrale import LLM, SamplingParams
from metrale.config.engine_args import EngineArgs
from metrale.config.errors import OptionError
from metrale.config.model_config import ModelLoadError, load_model_config
from metrale.layers.mla import indexer_torch_backend
from metrale.layers.mla.indexer_torch_backend import TorchIndexerBackend, gather_keys, index_scores
from metrale.models.registry import supported_architectures
from metrale.startup.memory import plan_memory
from mla_checkpoints import make_mla_checkpoint
from parallel_cases import free_port
from test_generation_vs_hf import NEW_TOKENS, generate, make_prompts

FAMILIES = sorted(DSA_FAMILIES)

dsa_checkpoint, expected = family_fixtures(make_dsa_checkpoint, "dsa_checkpoint")


def _check_selections(monkeypatch):
    """Rescores every selection the engine makes from here on: rows past position index_topk - 1
    keep index_topk positions, and the last kept and the best dropped score are apart by more
    than float rounding, so transformers cannot keep another set. -> the counts, filled in as
    the engine runs: {"rows dropping": n, "smallest gap": g}."""
    seen = {"rows dropping": 0, "smallest gap": float("inf")}
    select = TorchIndexerBackend.select

    def checked(self, q, weights, cache, metadata, index_topk):
        assert index_topk == INDEX_TOPK
        out = select(self, q, weights, cache, metadata, index_topk)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            scores = index_scores(q[start:start + query_len], weights[start:start + query_len],
                                  gather_keys(cache, metadata.block_tables[i], seq_len))
            for j in range(query_len):
                position = seq_len - query_len + j
                if position >= index_topk:
                    ranked = scores[j, :position + 1].sort(descending=True).values
                    gap = float(ranked[index_topk - 1] - ranked[index_topk])
                    seen["smallest gap"] = min(seen["smallest gap"], gap)
                    seen["rows dropping"] += 1
                    assert (out[start + j] >= 0).sum() == index_topk
            start += query_len
        return out

    monkeypatch.setattr(indexer_torch_backend.TorchIndexerBackend, "select", checked)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_then_prefix_hits_match_transformers(family, dsa_checkpoint, expected, monkeypatch):
    """Also the premise of comparing tokens exactly: the selections really drop positions, and
    none has a tie at its boundary (_check_selections)."""
    seen = _check_selections(monkeypatch)
    llm, first, second, hits = generate_twice(dsa_checkpoint(family))
    assert first == second == expected(family)
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > hits  # cached latents and indexer keys reused
    assert_idle(llm)
    assert seen["rows dropping"] > 1000
    assert seen["smallest gap"] > 1e-6, seen


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_transformers(family, dsa_checkpoint, expected):
    _, tokens = generate(dsa_checkpoint(family), max_num_batched_tokens=16)
    assert tokens == expected(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_matches_transformers(family, dsa_checkpoint, expected):
    llm, tokens = generate(dsa_checkpoint(family), num_kv_blocks=70, block_size=4, max_num_batched_tokens=32)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert tokens == expected(family)
    assert_idle(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_matches_transformers(family, dsa_checkpoint, expected):
    """Two ranks: MLA heads split, the indexer replicated (the same selection on both)."""
    llm, tokens = generate(dsa_checkpoint(family), max_num_batched_tokens=16, tp_size=2, master_port=free_port())
    try:
        assert llm.llm_engine.executor.world_size == 2
    finally:
        llm.llm_engine.shutdown()
    assert tokens == expected(family)


def _first_step_selections(path, monkeypatch, **engine_args):
    """The selections of the first step (every full layer's, in order) of a run of the standard
    prompts for one token each: the same prompt rows in either run, whatever the cache dtype."""
    calls, select = [], TorchIndexerBackend.select

    def recorded(self, q, weights, cache, metadata, index_topk):
        out = select(self, q, weights, cache, metadata, index_topk)
        calls.append((metadata.seq_lens_cpu, out))
        return out

    monkeypatch.setattr(indexer_torch_backend.TorchIndexerBackend, "select", recorded)
    llm = LLM(path, dtype="float32", device="cpu", **engine_args)
    llm.generate([{"prompt_token_ids": p} for p in make_prompts()], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    return [out for lens, out in calls if lens == calls[0][0]]


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_indexer_cache_runs_end_to_end_and_keeps_98_percent_of_the_selections(family, dsa_checkpoint,
                                                                                    monkeypatch):
    """Keys in e4m3 with a float32 scale per token, against keys in bfloat16 (the model in
    float32): layer 0 of the first step (the prompts' prefill, 500+ rows) keeps at least 98% of
    the bfloat16 selection. Only layer 0 sees the same inputs in both runs: a later layer's
    hidden states already differ by the earlier layers' changed selections, which this random
    tiny model amplifies (its layer 2 agrees on about 77%), so it measures the model, not the
    cache. Tokens are not compared, for the same reason; benchmarks/indexer_fp8_agreement.py
    measures the agreement at DeepSeek-V3.2's shapes."""
    path = dsa_checkpoint(family)
    fp8 = _first_step_selections(path, monkeypatch, indexer_cache_dtype="fp8")
    bf16 = _first_step_selections(path, monkeypatch, indexer_cache_dtype="bfloat16")
    kept = total = 0
    for row_a, row_b in zip(fp8[0].tolist(), bf16[0].tolist()):
        listed = {p for p in row_b if p >= 0}
        kept += len(listed & set(row_a))
        total += len(listed)
    assert total > 5000
    assert 0.98 <= kept / total < 1.0, kept / total  # below 1: fp8 does move some picks


def test_fp8_indexer_cache_runs_end_to_end(dsa_checkpoint):
    """GLM-5 with fp8 keys and float32 scales bound to its full layers, the prompts batched."""
    llm, tokens = generate(dsa_checkpoint("glm_moe_dsa"), indexer_cache_dtype="fp8")
    assert [len(t) for t in tokens] == [NEW_TOKENS] * len(make_prompts())
    caches = [m.indexer.cache for m in llm.llm_engine.runner.model.modules() if getattr(m, "indexer", None)]
    assert len(caches) == 2  # layers 0 and 2; the shared layers have none
    assert all(c.keys.dtype == torch.float8_e4m3fn and c.scales.dtype == torch.float32 for c in caches)
    assert_idle(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_token_prediction_layer_loads_with_its_indexer(family, dsa_checkpoint, tmp_path):
    """A next-n layer (a copy of a full layer, plus enorm, hnorm, eh_proj, shared_head) loads
    into model.mtp, hashed, its indexer's weights included; its caches stay out of the layout."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "with_mtp")
    shutil.copytree(dsa_checkpoint(family), path)
    n = json.loads((tmp_path / "with_mtp" / "config.json").read_text())["num_hidden_layers"]
    weights = load_file(os.path.join(path, "model.safetensors"))
    source = f"model.layers.{n - 2}."  # a full layer in both families
    mtp = {name.replace(source, f"model.layers.{n}."): t.clone() for name, t in weights.items()
           if name.startswith(source)}
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    mtp.update({f"model.layers.{n}.{norm}.weight": torch.ones(64) for norm in ("enorm", "hnorm", "shared_head.norm")})
    save_file({**weights, **mtp}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "with_mtp" / "config.json").read_text())
    (tmp_path / "with_mtp" / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
    llm = LLM(path, dtype="float32", device="cpu")
    model = llm.llm_engine.runner.model
    assert len(model.mtp) == 1 and model.mtp_sha256 is not None
    indexer = model.mtp[0].block.self_attn.indexer
    torch.testing.assert_close(indexer.wk.weight, model.model.layers[n - 2].self_attn.indexer.wk.weight)
    assert [entry.layer_index for entry in llm.llm_engine.runner.layout.layers] == list(range(n))


def _plan(path, **args):
    args = EngineArgs(model=path, **args)
    config = load_model_config(path, args.dtype, torch.device("cpu"), None, supported_architectures(),
                               args.config_overrides)
    return plan_memory(args, config, torch.device("cpu"))


@pytest.mark.parametrize("flag, key_bytes", [("auto", 32 * 2), ("fp8", 32 + 4)])
def test_memory_plan_counts_indexer_keys_of_full_layers_only(dsa_checkpoint, flag, key_bytes):
    plan = _plan(dsa_checkpoint("glm_moe_dsa"), dtype="bfloat16", indexer_cache_dtype=flag)
    assert plan.kv_bytes_per_token == 4 * (32 + 16) * 2 + 2 * key_bytes  # 4 latents, keys of layers 0 and 2
    table = plan.table()
    assert "mla: 4 layer(s) 0-3, 1 x (48,) bfloat16 per token (96 B/token each)" in table
    if flag == "fp8":
        assert "indexer: 2 layer(s) 0,2, 1 x (32,) float8_e4m3fn per token (32 B/token each)" in table
        assert "indexer: 2 layer(s) 0,2, 1 x (1,) float32 per token (4 B/token each)" in table
    else:
        assert "indexer: 2 layer(s) 0,2, 1 x (32,) bfloat16 per token (64 B/token each)" in table


def test_memory_plan_of_deepseek_v32(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V32))
    args = EngineArgs(model=str(tmp_path), load_format="dummy", max_model_len=32768, indexer_cache_dtype="fp8",
                      hf_overrides={"num_hidden_layers": 4})
    config = load_model_config(str(tmp_path), args.dtype, torch.device("cuda"), args.max_model_len,
                               supported_architectures(), args.config_overrides)
    plan = plan_memory(args, config, torch.device("cuda"), 141 * 2**30)
    assert plan.kv_bytes_per_token == 4 * ((512 + 64) * 2 + 128 + 4)  # latent, fp8 keys, a float32 scale


def test_fp8_indexer_cache_is_refused_for_a_model_without_an_indexer(tmp_path):
    path = make_mla_checkpoint(str(tmp_path), "deepseek_v3")
    with pytest.raises(OptionError, match="--indexer-cache-dtype fp8: DeepseekV3ForCausalLM has no DSA indexer"):
        LLM(path, device="cpu", indexer_cache_dtype="fp8")


@pytest.mark.parametrize("override, named", [
    ({"indexer_types": ["shared", "full", "full", "shared"]}, "indexer_types[0]='shared'"),
    ({"indexer_types": ["full", "sparse", "full", "shared"]}, "indexer_types with 'sparse'"),
    ({"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]}, "mlp_layer_types="),
])
def test_glm5_options_met_does_not_run_are_refused_by_name(dsa_checkpoint, override, named):
    with pytest.raises(ModelLoadError, match=f"config options met does not implement: .*{named}".replace("[", r"\[")):
        LLM(dsa_checkpoint("glm_moe_dsa"), device="cpu", hf_overrides=override)
