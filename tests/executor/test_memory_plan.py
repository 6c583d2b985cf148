"""The memory plan on the configs of real models, against hand-computed numbers."""

import pytest
import torch

from metrale.config.engine_args import EngineArgs
from metrale.config.model_config import load_model_config
from metrale.startup.memory import plan_memory
from metrale.startup.model_source import resolve_model_dir
from metrale.executor.memory_plan import MemoryPlanError, fit_kv_blocks, resolve_max_num_seqs
from metrale.models.registry import supported_architectures

H200 = 139.8 * 2**30
CUDA = torch.device("cuda")


def plan_for(name, device_total=H200, **kw):
    args = EngineArgs(model=name, load_format="dummy", **kw)
    config = load_model_config(resolve_model_dir(name, "dummy"), args.dtype, CUDA, args.max_model_len,
                               supported_architectures())
    return plan_memory(args, config, CUDA, int(device_total))


# 2 (K and V) x layers x KV heads x head_dim x 2 bytes (bf16)
@pytest.mark.parametrize("name,kv_bytes", [("Qwen3-8B", 2 * 36 * 8 * 128 * 2),
                                           ("Llama-3.1-8B", 2 * 32 * 8 * 128 * 2),
                                           ("Qwen3-0.6B", 2 * 28 * 8 * 128 * 2),
                                           ("Qwen3-30B-A3B", 2 * 48 * 4 * 128 * 2)])
def test_kv_bytes_per_token(name, kv_bytes):
    assert plan_for(name).kv_bytes_per_token == kv_bytes
    assert plan_for(name, kv_cache_dtype="fp8").kv_bytes_per_token == kv_bytes // 2


def test_weight_bytes_are_exact_for_qwen3_8b():
    hidden, inter, vocab, layers, q, kv = 4096, 12288, 151936, 36, 32 * 128, 8 * 128
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden + 2 * 128
    params = 2 * vocab * hidden + layers * per_layer + hidden
    assert plan_for("Qwen3-8B").weight_bytes == 2 * params


def test_tied_embeddings_are_counted_once():
    plan = plan_for("Qwen3-0.6B")
    hidden, inter, vocab, layers, q, kv = 1024, 3072, 151936, 28, 16 * 128, 8 * 128
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden + 2 * 128
    assert plan.weight_bytes == 2 * (vocab * hidden + layers * per_layer + hidden)


def test_kv_cache_takes_what_the_budget_leaves():
    plan = fit_kv_blocks(plan_for("Qwen3-8B", max_num_seqs=1024))
    left = plan.budget_bytes - plan.weight_bytes - plan.activation_reserve_bytes - plan.runtime_overhead_bytes
    assert 0 <= left - plan.kv_cache_bytes < plan.kv_bytes_per_block
    assert plan.budget_bytes == int(H200 * 0.9)


def test_kv_cache_capped_by_sequences_times_context():
    plan = fit_kv_blocks(plan_for("Qwen3-0.6B", max_num_seqs=2, max_model_len=1024))
    assert plan.num_kv_blocks == 2 * 1024 // 16


def test_a_model_that_cannot_fit_is_refused_with_the_plan_and_the_fix():
    with pytest.raises(MemoryPlanError) as e:
        fit_kv_blocks(plan_for("Llama-3.1-8B", device_total=16 * 2**30))
    message = str(e.value)
    assert "does not fit" in message and "weights" in message and "--max-model-len" in message
    assert "--gpu-memory-utilization" in message and "--tp-size" in message


def test_shorter_context_makes_it_fit():
    plan = fit_kv_blocks(plan_for("Llama-3.1-8B", device_total=24 * 2**30, max_model_len=8192))
    assert plan.kv_capacity_tokens >= 8192


def test_max_num_seqs_auto():
    assert resolve_max_num_seqs("auto", capacity_tokens=788_576, max_model_len=40960) == 192
    assert resolve_max_num_seqs("auto", capacity_tokens=1000, max_model_len=40960) == 8
    assert resolve_max_num_seqs(64, capacity_tokens=1, max_model_len=1) == 64


def test_met_memory_plan_prints_the_plan(capsys):
    from metrale.entrypoints.cli import main

    assert main(["memory-plan", "--model", "Qwen3-8B", "--load-format", "dummy", "--device-memory-gib", "139.8"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token     147,456" in out and "weights                15.26 GiB" in out
    assert main(["memory-plan", "--model", "Llama-3.1-8B", "--load-format", "dummy",
                 "--device-memory-gib", "16"]) == 1


def test_met_memory_plan_per_rank_when_split(capsys):
    from metrale.entrypoints.cli import main

    assert main(["memory-plan", "--model", "Qwen3-8B", "--load-format", "dummy", "--device-memory-gib", "139.8",
                 "--tp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "weights                7.63 GiB" in out and "KV bytes per token     73,728" in out
    assert "per rank: rank 0 of" in out
    from metrale.distributed.parallel_state import is_single_rank

    assert is_single_rank()  # the planning left no parallel state behind


def test_speculation_reserves_logits_for_every_verify_row():
    """A verify step samples 1 + k rows per sequence, each with a vocabulary of float32 logits and
    the sampler's copies: the activation reserve counts max_num_seqs x (1 + k) rows (within the
    step's token budget), so an eager verify step of that many rows fits as the graphs do."""
    from metrale.startup.memory import sampled_rows

    ngram = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert sampled_rows(EngineArgs(model="Qwen3-8B", max_num_seqs=16)) == 16
    assert sampled_rows(EngineArgs(model="Qwen3-8B", max_num_seqs=16, speculative_config=ngram)) == 64
    plain = plan_for("Qwen3-8B", max_num_seqs=16).activation_reserve_bytes
    drafting = plan_for("Qwen3-8B", max_num_seqs=16, speculative_config=ngram).activation_reserve_bytes
    assert drafting - plain == 4 * 4 * (64 - 16) * 151936  # fp32 logits and three working copies per row
