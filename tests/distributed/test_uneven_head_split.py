"""Uneven tensor-parallel head splits (distributed/head_split.py): heads that do not divide over
the ranks split as evenly as possible, the first ranks taking one more.

End to end on the CPU with gloo, tp=3, float32, greedy token ids equal transformers' and one
rank's, under a 16-token step budget (chunked prefill beside decodes):
- Qwen3 with 10 query heads over 5 KV heads: KV heads 2/2/1, query heads in whole groups 4/4/2
  (the q/k norms, GQA, o_proj's matching input partition);
- DeepSeek-V3 (MLA) with 5 heads: 2/2/1 over q_b_proj, kv_b_proj and o_proj, latent replicated.
Each logs the split once, from rank 0. Then the rules and the refusals, which need no ranks: a
KV group that would be cut over its replicas, MiniMax-M2's full-width norms, and an FP8 layer
whose uneven input split cuts a quantization block.
"""

from __future__ import annotations

import logging

import pytest
import torch

from checkpoints import load_reference, make_checkpoint, reference_greedy
from metrale import LLM, SamplingParams
from metrale.config.model_config import load_model_config
from metrale.config.quantization import Fp8Config
from metrale.distributed.head_split import attention_split, split_evenly, split_heads, working_tp_sizes
from metrale.distributed.launch import shard_sizes_of
from metrale.distributed.topology import TopologyError, resolve_topology
from metrale.layers.deferred_weights import deferred_weights
from metrale.layers.linear import RowParallelLinear
from metrale.layers.quantization.apply import quantize_model
from metrale.models.registry import supported_architectures
from metrale.startup.parallel import check_model_split
from mla_checkpoints import make_mla_checkpoint
from moe_checkpoints import make_moe_checkpoint
from parallel_cases import free_port, make_prompts

NEW_TOKENS = 8
# Intermediate widths that divide over 3 ranks (only heads may split unevenly).
QWEN3_UNEVEN = dict(num_attention_heads=10, num_key_value_heads=5, head_dim=16, intermediate_size=96)
MLA_UNEVEN = dict(num_attention_heads=5, num_key_value_heads=5, intermediate_size=96, moe_intermediate_size=48)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _run(path: str, caplog, **kwargs) -> tuple[list[list[int]], list[str]]:
    """Greedy tokens and the uneven-split log lines of one engine."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="metrale.startup.parallel"):
        llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=16, **kwargs)
    try:
        tokens = _greedy(llm)
    finally:
        llm.llm_engine.shutdown()
    return tokens, [r.getMessage() for r in caplog.records if r.getMessage().startswith("Uneven TP head split")]


def _reference(path: str) -> list[list[int]]:
    model = load_reference(path)
    return [reference_greedy(model, p, NEW_TOKENS) for p in make_prompts()]


def test_gqa_heads_split_unevenly_in_whole_kv_groups(tmp_path, caplog):
    path = make_checkpoint(str(tmp_path / "qwen3"), "qwen3", **QWEN3_UNEVEN)
    expected = _reference(path)
    one_rank, _ = _run(path, caplog)
    three, logged = _run(path, caplog, tp_size=3, master_port=free_port())
    assert one_rank == three == expected
    assert logged == ["Uneven TP head split over tp_size=3: model.layers.*.self_attn.qkv_proj in 2 layer(s) 0-1: "
                      "query heads 4/4/2, KV heads 2/2/1 per rank"]


def test_mla_heads_split_unevenly(tmp_path, caplog):
    path = make_mla_checkpoint(str(tmp_path / "deepseek_v3"), "deepseek_v3", **MLA_UNEVEN)
    expected = _reference(path)
    one_rank, _ = _run(path, caplog)
    three, logged = _run(path, caplog, tp_size=3, master_port=free_port())
    assert one_rank == three == expected
    assert logged == ["Uneven TP head split over tp_size=3: model.layers.*.self_attn in 3 layer(s) 0-2: "
                      "heads 2/2/1 per rank"]


# -- the rules, and what is refused ----------------------------------------------------------------

def test_split_evenly_gives_the_first_ranks_one_more():
    assert split_evenly(5, 3) == (2, 2, 1)
    assert split_evenly(64, 3) == (22, 21, 21)
    assert split_evenly(8, 4) == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="2 MLA attention heads cannot be split over 3 tensor-parallel ranks: every "
                                         "rank needs at least one"):
        split_heads(2, 3, "MLA attention heads")


def test_attention_split_keeps_query_groups_whole():
    split = attention_split(10, 5, 3)
    assert (split.q_heads, split.kv_heads) == ((4, 4, 2), (2, 2, 1))
    assert (split.q_start, split.kv_start) == ((0, 4, 8), (0, 2, 4))
    replicated = attention_split(8, 2, 4)  # each KV head on 2 ranks, its 4 query heads 2 + 2
    assert (replicated.q_heads, replicated.kv_start, replicated.uneven) == ((2,) * 4, (0, 0, 1, 1), False)
    assert working_tp_sizes(12, 4) == [1, 2, 3, 4, 12]


def test_a_kv_group_cut_over_its_replicas_is_refused(tmp_path):
    path = make_checkpoint(str(tmp_path / "qwen3"), "qwen3", num_attention_heads=6, num_key_value_heads=2)
    config = load_model_config(path, "float32", torch.device("cpu"), None, supported_architectures())
    with pytest.raises(TopologyError, match=r"^Qwen3ForCausalLM: 6 attention heads cannot be split evenly over "
                                            r"tp_size=4, and with fewer KV heads \(2\) than ranks an uneven split "
                                            r"would cut a KV head's query group"):
        check_model_split(config, resolve_topology(4, 1), "ep")


def test_minimax_full_width_norms_refuse_an_uneven_split(tmp_path):
    path = make_moe_checkpoint(str(tmp_path / "minimax"), "minimax_m2", num_attention_heads=3, num_key_value_heads=3)
    config = load_model_config(path, "float32", torch.device("cpu"), None, supported_architectures())
    with pytest.raises(TopologyError, match="MiniMax-M2's full-width q/k norms do not support yet"):
        check_model_split(config, resolve_topology(2, 1), "ep")


class _OneProjection(torch.nn.Module):
    def __init__(self, partition):
        super().__init__()
        self.o_proj = RowParallelLinear(sum(partition), 64, input_partition=partition)


def test_fp8_uneven_input_split_that_cuts_a_block_is_refused():
    fp8 = Fp8Config(block_n=64, block_k=64, activation_group=None)
    whole = (128, 128, 64)  # 5 heads of 64 over 3 ranks: every share whole blocks
    with shard_sizes_of(resolve_topology(3, 1), "ep"), deferred_weights():
        layer = _OneProjection(whole)
        quantize_model(layer, fp8, torch.device("cpu"), torch.float32)
        assert layer.o_proj.fp8 is not None and layer.o_proj.weight.shape == (64, 128)
        cut = (64, 64, 32)  # 5 heads of 32: rank 2's 32 columns are half a block
        with pytest.raises(TopologyError, match=r"o_proj: its 160 input features split over 3 ranks into 64/64/32 "
                                                r"per rank, which cuts the 64-wide groups"):
            quantize_model(_OneProjection(cut), fp8, torch.device("cpu"), torch.float32)
