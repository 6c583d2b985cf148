"""Forward passes that run once, at startup, before the scheduler holds any block or slot:
measuring the activation peak, calibrating fp8 KV scales, and the warm-up's plans. Each lays its
sequences out from block 0 and state slot 0, and leaves no request behind in the runner."""

from __future__ import annotations

import torch

from metrale.executor.model_runner import ModelRunner
from metrale.executor.sampler import SamplingRow, sample
from metrale.layers.attention.layer import Attention
from metrale.messages.sampling_params import SamplingParams
from metrale.messages.scheduler_output import NewRequestData, SchedulerOutput


def prefill_plan(runner: ModelRunner, sequences: list[list[int]], tag: str) -> SchedulerOutput:
    """A plan computing whole `sequences` at once, in consecutive blocks from block 0 and in state
    slots 0, 1, ... (nothing else holds the pool at startup)."""
    plan, first_block = SchedulerOutput(), 0
    for i, tokens in enumerate(sequences):
        blocks = -(-len(tokens) // runner.block_size)
        plan.new_requests.append(NewRequestData(f"{tag}_{i}", tokens, len(tokens), SamplingParams(temperature=0),
                                                0, list(range(first_block, first_block + blocks)), 0, state_slot=i))
        plan.num_scheduled_tokens[f"{tag}_{i}"] = len(tokens)
        first_block += blocks
    return plan


@torch.inference_mode()
def forward_whole(runner: ModelRunner, plan: SchedulerOutput) -> torch.Tensor:
    """The hidden states of every token of a startup plan (no sampling)."""
    runner.apply_plan(plan)
    return runner.forward(runner.prepare_inputs(plan))


@torch.inference_mode()
def profile_activation_bytes(runner: ModelRunner, num_tokens: int, num_sampled: int, max_model_len: int) -> int:
    """Peak transient memory of the largest step, measured on CUDA: a forward pass over
    `num_tokens` tokens (as sequences of at most `max_model_len`), then logits and the sampler
    for `num_sampled` rows. A throwaway cache just large enough is used and freed."""
    device = runner.device
    lengths = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
    runner.allocate_caches(sum(-(-n // runner.block_size) for n in lengths), len(lengths))
    plan = prefill_plan(runner, [[1] * n for n in lengths], "__profile")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    hidden = forward_whole(runner, plan)
    rows = min(num_sampled, hidden.shape[0])
    logits = runner.model.compute_logits(hidden[:rows])
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
    sample(logits, [SamplingRow(params, i, [1], 1) for i in range(rows)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del hidden, logits
    runner.drop_requests()
    runner.release_caches()
    return peak


def attention_layers(runner: ModelRunner) -> list[Attention]:
    return [layer for layer in runner.layers if isinstance(layer, Attention)]


@torch.inference_mode()
def calibrate_kv_scales(runner: ModelRunner, token_ids: list[int], headroom: float, max_model_len: int) -> None:
    """Set each fp8 layer's K and V scale from the largest values a forward pass over
    `token_ids` produces (in chunks of at most max_model_len): amax x headroom maps to 448."""
    layers = attention_layers(runner)
    for layer in layers:
        layer.observed_amax = [0.0, 0.0]
    for start in range(0, len(token_ids), max_model_len):  # one sequence at a time, from block 0
        forward_whole(runner, prefill_plan(runner, [token_ids[start:start + max_model_len]], "__calibrate"))
        runner.drop_requests()
    for layer in layers:
        k_amax, v_amax = layer.observed_amax
        layer.observed_amax = None
        if layer.cache_dtype == torch.float8_e4m3fn:
            layer.k_scale = max(k_amax * headroom / 448.0, 1e-6)
            layer.v_scale = max(v_amax * headroom / 448.0, 1e-6)
