"""Compile the Triton kernels a server meets in its first minutes, before it takes requests.

Triton compiles a kernel the first time it is launched with a new set of compile-time
constants (about a second each on an H200 with a cold cache). Without this warm-up the first
steps that reach a new variant stall: in one measured run of the nano-vllm workload, 11 of its
17 seconds went to such compiles in the middle of the run (steps with prefill chunks, and the
step where the batch fell below the SM count and the sampler changed paths).

What varies from step to step without changing a kernel's constants is kept out of Triton's
specialisation (`do_not_specialize` on batch sizes and block-table widths; 16-byte aligned
input views in the runner), so the variants are few and known:
  * the extend kernel's row tile (16, 32 or 64 query rows per program, from the longest chunk
    times the GQA group): prefills of 1..33 tokens reach all three;
  * eager split-KV decode over a table of several splits;
  * the sampler's two paths for temperature sampling (a program per row and chunk below the
    SM count, a program per row at or above it);
  * the structured-output token bitmask, on logits of the LM head's dtype and of float32 (a
    batch with penalties), so the first constrained request compiles nothing;
  * in engines that schedule asynchronously, the fix-up of a step's inputs from the step in
    flight (kernels/step_inputs.py), with a verify step's accepted counts aligned and not;
  * the grouped MoE GEMMs' tiles, which depend on the step's token count (a table measured per
    shape, layers/moe/triton_moe.py): every pair a step up to the token budget can take, per
    distinct bf16 expert shape.
Decode CUDA graphs compile their kernels when they are captured. Filters (top-k, top-p,
min-p) compile on the first request that uses them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from metrale.executor.sampler import SamplingRow, sample_tokens
from metrale.executor.startup_passes import forward_whole, prefill_plan
from metrale.kernels import HAS_TRITON, num_sms
from metrale.kernels.step_inputs import fill_step_inputs
from metrale.kernels.token_bitmask import apply_token_bitmask
from metrale.messages.sampling_params import SamplingParams
from metrale.messages.scheduler_output import CachedRequestData, SchedulerOutput

logger = logging.getLogger(__name__)

# Prompt lengths whose query rows (length x GQA group) fall in every row-tile bin of the extend
# kernel for any group size from 1 to 32: <= 16, 17..32 and > 32 rows.
PREFILL_LENGTHS = (1, 2, 3, 5, 9, 17, 33)
DECODE_CONTEXT = 300  # keys: more than one split of the eager decode kernel
# Under Triton's CPU interpreter (the kernel audit of `--check-kernels` on a CPU) every program
# instance is interpreted in Python: one prefill per row-tile family and a short decode.
INTERPRETED_PREFILL_LENGTHS = (1, 33)
INTERPRETED_DECODE_CONTEXT = 40


def warm_up_steps(runner, max_num_seqs: int, max_num_tokens: int = 0,
                  asynchronous: bool = False) -> list[tuple[str, Callable[[], None]]]:
    """The warm-up as named steps, each one forward (or sampler call) reaching the variants
    above. Each uses the KV pool from block 0 (nothing else holds it at startup) and leaves no
    request behind. max_num_tokens: the step token budget (0: no MoE tiles step); asynchronous:
    the engine schedules asynchronously (its steps' inputs are fixed up on the device)."""
    vocab = runner.model_config.vocab_size
    pool_tokens = runner.caches.num_blocks * runner.block_size
    interpreted = runner.device.type != "cuda"
    lengths = INTERPRETED_PREFILL_LENGTHS if interpreted else PREFILL_LENGTHS
    context = INTERPRETED_DECODE_CONTEXT if interpreted else DECODE_CONTEXT
    steps = []

    def prefill(length):
        try:
            forward_whole(runner, prefill_plan(runner, [[1] * length], "__warmup"))
        finally:
            runner.drop_requests()

    def sample(rows):
        # in the LM head's dtype, as the engine hands them over (a kernel variant per dtype)
        logits = torch.randn(rows, vocab, device=runner.device, dtype=runner.model_config.dtype)
        params = SamplingParams(temperature=0.6)
        sample_tokens(logits, [SamplingRow(params, i, [1], 1) for i in range(rows)]).tokens.tolist()

    steps += [(f"prefill {n}", functools.partial(prefill, n)) for n in lengths if n <= pool_tokens]
    if context + 1 <= pool_tokens:
        steps.append(("decode", functools.partial(_decode_once, runner, vocab, context)))
    steps += [(f"sample {rows}", functools.partial(sample, rows))
              for rows in sorted({1, min(max_num_seqs, num_sms(runner.device))})]
    if max_num_tokens and not interpreted and HAS_TRITON:
        steps += [(f"moe tiles {tuple(layer.w13.shape)}", functools.partial(_moe_tiles, layer, max_num_tokens))
                  for layer in _distinct_bf16_experts(runner.model)]
    if asynchronous:
        steps.append(("last-step fill", functools.partial(_fill_from_last_step, runner.device)))
    if runner.grammars is not None:
        dtypes = dict.fromkeys([runner.model_config.dtype, torch.float32])
        steps += [(f"token bitmask {str(dtype).removeprefix('torch.')}", functools.partial(_bitmask, runner, dtype))
                  for dtype in dtypes]
    return steps


def _distinct_bf16_experts(model) -> list:
    """One FusedMoE layer per distinct (weight shape, dtype, top-k, clamp) whose experts take the
    grouped GEMMs (FP8 experts have their own kernels)."""
    from metrale.layers.moe import FusedMoE

    seen = {}
    for module in model.modules():
        if isinstance(module, FusedMoE) and module.fp8 is None and module.w13.numel():
            key = (tuple(module.w13.shape), module.w13.dtype, module.top_k, module.swiglu_limit)
            seen.setdefault(key, module)
    return list(seen.values())


def _moe_tiles(layer, max_num_tokens: int) -> None:
    from metrale.layers.moe.triton_moe import compile_tiles

    compile_tiles(layer.w13, layer.w2, layer.top_k, max_num_tokens, layer.expert_start, layer.swiglu_limit)


def _fill_from_last_step(device: torch.device) -> None:
    """The asynchronous steps' input fix-up (kernels/step_inputs.py), with a verify step's
    accepted counts 16-byte aligned and at an 8-byte offset (its two variants)."""
    def longs(*values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    for offset in (0, 1):
        accepted = longs(0, 0)[offset:offset + 1]
        fill_step_inputs(longs(1, 2), longs(5, 6), longs(5, 6), torch.tensor([7], dtype=torch.int32, device=device),
                         torch.zeros(1, 2, dtype=torch.int32, device=device), 16, tokens=longs(3),
                         token_holes=longs(0), token_sources=longs(0), drafts=longs(4), draft_holes=longs(1),
                         draft_sources=longs(0), accepted=accepted, moved_seqs=longs(0), moved_unverified=longs(0),
                         moved_last_rows=longs(0), moved_rows=longs(0, 1), moved_row_seqs=longs(0, 0))


def _bitmask(runner, dtype: torch.dtype) -> None:
    vocab = runner.sampled_vocab_size or runner.model_config.vocab_size
    logits = torch.zeros(1, vocab, device=runner.device, dtype=dtype)
    bitmask = torch.zeros(1, -(-vocab // 32), device=runner.device, dtype=torch.int32)
    apply_token_bitmask(logits, bitmask, torch.zeros(1, dtype=torch.int64, device=runner.device))


@torch.inference_mode()
def warm_up_kernels(runner, max_num_seqs: int) -> float:
    """Run the kernel variants above once on the runner's device; returns the seconds taken."""
    start = time.perf_counter()
    with runner.kernel_context():
        for _, step in warm_up_steps(runner, max_num_seqs):
            step()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - start
    logger.info("kernels warmed up in %.2fs", seconds)
    return seconds


def _decode_once(runner, vocab: int, context: int) -> None:
    """One eager pure-decode step after a `context`-token prefill."""
    tokens = [i % vocab for i in range(context)]
    plan = prefill_plan(runner, [tokens], "__warmup")
    forward_whole(runner, plan)
    new = plan.new_requests[0]
    runner.requests[new.request_id].token_ids.append(1)
    blocks = -(-(context + 1) // runner.block_size)
    extra = list(range(len(new.block_ids), blocks))
    decode = SchedulerOutput(cached_requests=[CachedRequestData(new.request_id, extra, context)],
                             num_scheduled_tokens={new.request_id: 1})
    try:
        forward_whole(runner, decode)
    finally:
        runner.drop_requests()
