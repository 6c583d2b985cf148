"""GLM-5.3 (Glm5NextForConditionalGeneration served text-only by Glm5NextForCausalLM): greedy token
ids identical to transformers, float32, on tiny random checkpoints (tests/glm5_next_checkpoints.py:
KDA and MLA layers, a full and a shared indexed layer, pooled index groups of 4 with index_topk
24, hyper-connection streams, swiglu clamps, 3 heads that split 2/1 over two ranks).

As test_dsa_vs_hf.py: the seven standard prompts (1..250 tokens) together, then again on the
same engine with prefix hits (KDA state restored from a checkpoint, latents and pooled indexer
entries from the blocks); chunked by a 16-token step budget (chunks end inside index groups);
preempted by a tiny pool; over two CPU ranks (uneven head splits). The selections of the
batched run are rescored: they drop groups, and the last kept and the best dropped group are
apart by more than float rounding. Plus the cache layout and memory plan of the three kinds,
and the refusals.
"""

import json

import pytest
import torch

from family_cases import assert_idle, family_fixtures, generate_twice
from glm5_next_checkpoints import INDEX_KPOOL, INDEX_TOPK, VARIANTS, load_glm5_next_reference, make_glm5_next_checkpoint
from metrale import LLM, SamplingParams
from metrale.config.engine_args import EngineArgs
from metrale.config.errors import OptionError
from metrale.config.model_config import ModelLoadError, load_model_config
from metrale.layers.attention.torch_backend import gather_context
from metrale.layers.mla import indexer_pooled_torch_backend
from metrale.layers.mla.indexer_pooled_torch_backend import TorchPooledIndexerBackend
from metrale.layers.mla.indexer_pooling import group_keys
from metrale.layers.mla.indexer_torch_backend import index_scores
from metrale.models.registry import supported_architectures
from metrale.startup.memory import plan_memory
from parallel_cases import free_port
from test_generation_vs_hf import generate

glm5_next_checkpoint, expected = family_fixtures(make_glm5_next_checkpoint, "glm5_next_checkpoint",
                                                 load=load_glm5_next_reference)
MAIN = "glm5_next"


def _check_selections(monkeypatch):
    """Rescores every pooled selection from here on -> {"rows dropping": n, "smallest gap": g}:
    rows with more eligible groups than they keep, and the smallest gap between the last kept
    and the best dropped group score among them."""
    seen = {"rows dropping": 0, "smallest gap": float("inf")}
    select = TorchPooledIndexerBackend.select
    keep = INDEX_TOPK // INDEX_KPOOL

    def checked(self, q, weights, cache, metadata, index_topk, pooling, bias):
        out = select(self, q, weights, cache, metadata, index_topk, pooling, bias)
        assert out.shape[1] == pooling.width(INDEX_TOPK)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            keys = gather_context(cache.keys, metadata.block_tables[i], seq_len)
            gates = gather_context(cache.pool_gates, metadata.block_tables[i], seq_len)
            scores = index_scores(q[start:start + query_len], weights[start:start + query_len],
                                  group_keys(keys, gates, bias))
            rows = out[start:start + query_len].long()
            positions = torch.arange(seq_len - query_len, seq_len)
            eligible = (positions + 1) // INDEX_KPOOL
            dropping = eligible > keep
            if dropping.any():
                allowed = torch.arange(scores.shape[1])[None, :] < eligible[:, None]
                ranked = scores.masked_fill(~allowed, float("-inf"))[dropping].sort(dim=-1, descending=True).values
                seen["smallest gap"] = min(seen["smallest gap"], float((ranked[:, keep - 1] - ranked[:, keep]).min()))
                seen["rows dropping"] += int(dropping.sum())
                tail = (positions + 1) % INDEX_KPOOL * int(pooling.select_tail)
                assert ((rows >= 0).sum(-1)[dropping] == INDEX_TOPK + tail[dropping]).all()
            assert (rows.max(-1).values <= positions).all()
            listed = rows.sort(-1).values
            assert not ((listed[:, 1:] == listed[:, :-1]) & (listed[:, 1:] >= 0)).any()  # no position twice
            start += query_len
        return out

    monkeypatch.setattr(indexer_pooled_torch_backend.TorchPooledIndexerBackend, "select", checked)
    return seen


def test_batched_then_prefix_hits_match_transformers(glm5_next_checkpoint, expected, monkeypatch):
    seen = _check_selections(monkeypatch)
    llm, first, second, hits = generate_twice(glm5_next_checkpoint(MAIN))
    assert first == second == expected(MAIN)
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > hits
    assert_idle(llm)
    assert seen["rows dropping"] > 500  # one full indexed layer: the rows of 28+ positions
    assert seen["smallest gap"] > 1e-6, seen


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {MAIN}))
def test_batched_variant_matches_transformers(variant, glm5_next_checkpoint, expected):
    """The softplus decay (no lower bound) and no tail selection."""
    _, tokens = generate(glm5_next_checkpoint(variant))
    assert tokens == expected(variant)


def test_chunked_prefill_matches_transformers(glm5_next_checkpoint, expected):
    _, tokens = generate(glm5_next_checkpoint(MAIN), max_num_batched_tokens=16)
    assert tokens == expected(MAIN)


def test_preemption_matches_transformers(glm5_next_checkpoint, expected):
    llm, tokens = generate(glm5_next_checkpoint(MAIN), num_kv_blocks=70, block_size=4, max_num_batched_tokens=32)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert tokens == expected(MAIN)
    assert_idle(llm)


def test_tensor_parallel_with_uneven_heads_matches_transformers(glm5_next_checkpoint, expected):
    """Two ranks: 3 MLA heads and 3 KDA heads split 2/1; the indexer and hyper-connections
    replicated."""
    llm, tokens = generate(glm5_next_checkpoint(MAIN), max_num_batched_tokens=16, tp_size=2,
                           master_port=free_port())
    try:
        assert llm.llm_engine.executor.world_size == 2
    finally:
        llm.llm_engine.shutdown()
    assert tokens == expected(MAIN)


def _plan(path, **args):
    args = EngineArgs(model=path, **args)
    config = load_model_config(path, args.dtype, torch.device("cpu"), None, supported_architectures(),
                               args.config_overrides)
    return plan_memory(args, config, torch.device("cpu"))


def test_memory_plan_counts_the_three_kinds(glm5_next_checkpoint):
    plan = _plan(glm5_next_checkpoint(MAIN), dtype="bfloat16")
    # Two latents of 32 (no rope part), the full layer's keys and gate logits (32 each), bf16.
    assert plan.kv_bytes_per_token == 2 * 32 * 2 + 2 * 32 * 2
    table = plan.table()
    assert "mla: 2 layer(s) 1-2, 1 x (32,) bfloat16 per token (64 B/token each)" in table
    assert "pooled_indexer: 1 layer(s) 1, 2 x (32,) bfloat16 per token (128 B/token each)" in table
    assert "kda: 2 layer(s) 0,3" in table


def test_fp8_indexer_cache_is_refused_for_pooled_groups(glm5_next_checkpoint):
    with pytest.raises(OptionError, match="--indexer-cache-dtype fp8 is not implemented for pooled index groups"):
        LLM(glm5_next_checkpoint(MAIN), device="cpu", indexer_cache_dtype="fp8")


def test_vision_weights_are_skipped_and_the_text_config_read(glm5_next_checkpoint):
    path = glm5_next_checkpoint(MAIN)
    assert json.loads(open(f"{path}/config.json").read())["architectures"] == ["Glm5NextForConditionalGeneration"]
    llm = LLM(path, dtype="float32", device="cpu")
    model = llm.llm_engine.runner.model
    assert type(model).__name__ == "Glm5NextForCausalLM"
    assert not any("visual" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("override, named", [
    ({"indexer_types": ["full", "shared", "full", "full"]}, "indexer_types[1]='shared'"),
    ({"layer_types": ["linear_attention", "sliding_attention", "indexed_attention", "linear_attention"]},
     "layer_types with 'sliding_attention'"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types with 'moe'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"qk_rope_head_dim": 16}, "qk_rope_head_dim=16"),
    ({"num_key_value_heads": 1}, "num_key_value_heads=1"),
])
def test_options_met_does_not_run_are_refused_by_name(glm5_next_checkpoint, override, named):
    with pytest.raises(ModelLoadError, match=f"config options met does not implement: .*{named}".replace("[", r"\[")):
        LLM(glm5_next_checkpoint(MAIN), device="cpu", hf_overrides=override)


def test_memory_plan_of_the_shipped_config():
    """metrale/model_configs/GLM-5.3 (transformers' Glm5NextConfig defaults) cut to 8 layers: KDA
    0-2 and 4-6, MLA 3 and 7. Per token and MLA layer: the 512-value latent (no rope part) and
    the indexer's key and gate logits, 2 x 128, in bfloat16; per request and KDA layer: the conv
    state (3 x 3 x 64 x 128, bfloat16) and the float32 recurrent state (64 x 128 x 128)."""
    from metrale.startup.model_source import SHIPPED_CONFIGS

    path = f"{SHIPPED_CONFIGS}/GLM-5.3"
    args = EngineArgs(model=path, load_format="dummy", max_model_len=32768, hf_overrides={"num_hidden_layers": 8})
    config = load_model_config(path, args.dtype, torch.device("cuda"), args.max_model_len, supported_architectures(),
                               args.config_overrides)
    plan = plan_memory(args, config, torch.device("cuda"), 141 * 2**30)
    assert plan.kv_bytes_per_token == 2 * (512 * 2 + 2 * 128 * 2)
    assert "kda: 6 layer(s) 0-2,4-6, conv (3, 24576) bfloat16, recurrent (64, 128, 128) float32" in plan.table()


def test_dummy_weights_load_and_generate(glm5_next_checkpoint):
    """--load-format dummy draws transformers' in-memory names (attn_hc.fn, forget_gate.*, the
    concatenated conv1d, stacked experts), which load as the checkpoint's names do."""
    llm = LLM(glm5_next_checkpoint(MAIN), dtype="float32", device="cpu", load_format="dummy")
    outs = llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4


def test_the_triton_mla_backend_refuses_mla_without_rope(glm5_next_checkpoint):
    """Its kernels assume a rope part (GPU default: --attention-backend auto takes it on CUDA)."""
    from metrale.layers.mla.triton_backend import TritonMLABackend

    llm = LLM(glm5_next_checkpoint(MAIN), dtype="float32", device="cpu")
    llm.llm_engine.runner.backends["mla"] = TritonMLABackend()
    with pytest.raises(NotImplementedError, match="MLA without RoPE .* run with --attention-backend torch"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
