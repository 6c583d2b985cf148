"""The memory plan of startup: made before loading from a meta-device build of the model, then
measured on CUDA once the weights are in, and agreed between ranks."""

from __future__ import annotations

import logging
import os

import torch

from metrale.config.cache_config import CacheConfig
from metrale.config.engine_args import EngineArgs
from metrale.config.model_config import ModelConfig
from metrale.distributed.launch import ParallelRuntime
from metrale.executor.cache_layout import CacheLayout
from metrale.executor.drafters import drafter_buffer_bytes, drafter_cached_layers, drafter_weight_bytes
from metrale.executor.memory_plan import (CPU_DEFAULT_KV_BYTES, CUDA_RUNTIME_OVERHEAD_BYTES, MemoryPlan,
                                          MemoryPlanError, estimate_activation_bytes, estimate_encoder_bytes,
                                          finish_plan, fit_kv_blocks, parameter_bytes)
from metrale.executor.model_runner import ModelRunner
from metrale.executor.startup_passes import attention_layers, calibrate_kv_scales, profile_activation_bytes
from metrale.executor.model_loader import construct_model
from metrale.multimodal.processor import DEFAULT_LIMITS

logger = logging.getLogger(__name__)


def build_meta_model(config: ModelConfig, load_format: str = "auto") -> torch.nn.Module:
    """The model on the meta device: its parameters' sizes and its cache specs, no memory."""
    return construct_model(config, torch.device("meta"), load_format)


LM_HEAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def apply_lm_head_dtype(model: torch.nn.Module, args: EngineArgs) -> None:
    """--lm-head-dtype: the head's weight (and so the logits) in that type; auto keeps the model's."""
    if args.lm_head_dtype != "auto":
        model.lm_head.set_dtype(LM_HEAD_DTYPES[args.lm_head_dtype])


def _max_seqs(args: EngineArgs) -> int:
    """The sequences the plan sizes for before the KV pool is known (auto: 1,024)."""
    return 1024 if args.max_num_seqs == "auto" else int(args.max_num_seqs)


def sampled_rows(args: EngineArgs) -> int:
    """The most rows a step samples (each with a vocabulary of logits): one per sequence, and
    1 + k per sequence in a verify step where the engine speculates. Capped by the step's token
    budget where the activation estimate reads it."""
    spec = args.speculative_decoding
    return _max_seqs(args) * (1 + (spec.num_speculative_tokens if spec is not None else 0))


def plan_memory(args: EngineArgs, config: ModelConfig, device: torch.device,
                device_total: int | None = None) -> MemoryPlan:
    """The plan before loading: exact weights and cache sizes from a meta-device build, estimated
    activations."""
    meta_model = build_meta_model(config, args.load_format)
    apply_lm_head_dtype(meta_model, args)  # its bytes count as they will be
    # A runner-side drafter's caches (MTP's layer) count like the trunk's.
    layout = CacheLayout.of(meta_model, CacheConfig.from_args(args, config.dtype),
                            drafter_cached_layers(args.speculative_decoding, meta_model))
    activation = estimate_activation_bytes(config.hf_config, config.dtype, args.step_token_budget(device.type),
                                           sampled_rows(args), config.vocab_size)
    max_seqs = _max_seqs(args)
    weights = (parameter_bytes(meta_model) + drafter_weight_bytes(args.speculative_decoding, meta_model)
               + drafter_buffer_bytes(args.speculative_decoding, args.schedules_asynchronously(device.type),
                                      max_seqs, config.max_model_len))
    encoder, encoder_summary = encoder_reserve(args, config, meta_model, device)
    if device.type == "cuda" or device_total is not None:
        total = device_total if device_total is not None else torch.cuda.mem_get_info(device)[1]
        budget = int(total * args.gpu_memory_utilization)
        overhead = CUDA_RUNTIME_OVERHEAD_BYTES
        if args.kv_cache_memory is not None:
            budget = min(budget, weights + activation + encoder + overhead + args.kv_cache_memory)
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        overhead = 0
        budget = weights + activation + encoder + (args.kv_cache_memory or CPU_DEFAULT_KV_BYTES)
    checkpoints = args.state_checkpoint_slots if args.enable_prefix_caching else 0
    spec = args.speculative_decoding
    return MemoryPlan(device.type, total, budget, weights, activation, False, layout.bytes_per_token,
                      args.block_size, config.max_model_len, args.max_num_seqs, runtime_overhead_bytes=overhead,
                      state_bytes_per_slot=layout.bytes_per_slot, requested_checkpoint_slots=checkpoints,
                      draft_slots_per_seq=spec.num_speculative_tokens if spec is not None else 0,
                      cache_summary=layout.summary(),
                      weight_format=config.quantization.describe() if config.quantization is not None else "",
                      encoder_reserve_bytes=encoder, encoder_summary=encoder_summary)


def encoder_reserve(args: EngineArgs, config: ModelConfig, meta_model, device: torch.device) -> tuple[int, str]:
    """A vision-language model's encoder reserve (executor/memory_plan.py estimate_encoder_bytes)
    for the largest item its processor allows: an image of preprocessor_config.json's max pixels,
    lowered by --mm-processor-kwargs and --vision-max-pixels, or (videos allowed) a video of the
    encoder budget's tokens; the cache at the encoder budget (engine.py)."""
    vl_config = getattr(meta_model, "vl_config", None)
    if not getattr(meta_model, "supports_multimodal", False) or vl_config is None:
        return 0, ""
    import json

    path = os.path.join(config.model_dir, "preprocessor_config.json")
    processor = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            processor = json.load(f)
    size = processor.get("size") or {}
    max_pixels = int(processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
    max_pixels = int(args.processor_defaults.get("max_pixels", max_pixels))
    if args.vision_max_pixels is not None:
        max_pixels = min(max_pixels, args.vision_max_pixels)
    vision = vl_config.vision_config
    unit = int(processor.get("patch_size", vision.patch_size)) * int(processor.get("merge_size", 2))
    rows = args.max_num_encoder_tokens or max(args.step_token_budget(device.type), max_pixels // (unit * unit))
    width = 1 + len(getattr(vision, "deepstack_visual_indexes", None) or ())
    # A video is one item of many frames: the processor admits any item of up to `rows` tokens
    # (the encoder budget), so where videos are allowed the tower may see rows * unit^2 pixels.
    item_pixels = max_pixels
    if args.media_limits.get("video", DEFAULT_LIMITS["video"]) > 0:
        item_pixels = max(max_pixels, rows * unit * unit)
    return estimate_encoder_bytes(vision, config.hf_config.hidden_size, config.dtype, item_pixels, rows, width)


def measure_on_cuda(plan: MemoryPlan, runner: ModelRunner, args: EngineArgs, device: torch.device) -> None:
    """Replace the estimates with what the loaded model really uses."""
    plan.activation_reserve_bytes = profile_activation_bytes(runner, args.step_token_budget(device.type),
                                                             sampled_rows(args), plan.max_model_len)
    plan.activation_measured = True
    free, total = torch.cuda.mem_get_info(device)
    # Everything this process and others hold now, beyond our weights: context, workspaces.
    plan.runtime_overhead_bytes = max(0, (total - free) - plan.weight_bytes)


def calibrate_fp8_scales(args: EngineArgs, runner: ModelRunner, tokenizer, plan: MemoryPlan) -> None:
    """Scales from the checkpoint stay; otherwise calibrate over N tokens of English text (Python's
    own documentation, offline), or keep 1.0 when N is 0."""
    if args.kv_cache_dtype != "fp8" or args.fp8_kv_calibration_tokens == 0:
        return
    if any(layer.k_scale != 1.0 or layer.v_scale != 1.0 for layer in attention_layers(runner)):
        return  # the checkpoint carried k_scale / v_scale
    n = args.fp8_kv_calibration_tokens
    if tokenizer is not None:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
        ids = tokenizer.encode(text)[:n]
    else:
        ids = [(i * 7919) % runner.model_config.vocab_size for i in range(n)]
    calibrate_kv_scales(runner, ids, args.fp8_kv_headroom, min(plan.max_model_len, plan.kv_capacity_tokens))
    logger.info("fp8 KV scales calibrated over %d tokens (headroom %.2f)", len(ids), args.fp8_kv_headroom)


def fit_kv_blocks_on_every_rank(plan: MemoryPlan, args: EngineArgs, parallel: ParallelRuntime | None) -> None:
    """Rank 0's scheduler hands out block ids and state slots that every rank's pool must hold:
    all ranks take the smallest counts any of them fits (a rank that cannot fit at all sends 0
    and stops them all). Then `auto` running sequences follow the agreed capacity."""
    if parallel is None:
        finish_plan(fit_kv_blocks(plan, args.num_kv_blocks))
        return
    error = None
    try:
        fit_kv_blocks(plan, args.num_kv_blocks)
    except MemoryPlanError as e:
        error = e
    agreed = parallel.agree_min(0 if error is not None else plan.num_kv_blocks)
    if error is not None:
        raise error
    if agreed == 0:
        raise MemoryPlanError("another rank's memory plan does not fit (see its log)")
    if agreed < plan.num_kv_blocks:
        plan.notes.append(f"KV cache: {agreed} blocks, the smallest any of the "
                          f"{parallel.topology.world_size} ranks fits")
        plan.num_kv_blocks = agreed
    if plan.state_bytes_per_slot:
        plan.max_num_seqs = parallel.agree_min(plan.max_num_seqs)
        plan.num_checkpoint_slots = parallel.agree_min(plan.num_checkpoint_slots)
    finish_plan(plan)
