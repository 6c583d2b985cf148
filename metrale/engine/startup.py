"""Startup, in its phases: resolve the model, read the config, plan memory, load the weights,
size the KV cache. Each phase is logged with the time it took."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from metrale.config.engine_args import EngineArgs
from metrale.config.model_config import ModelConfig, ModelLoadError, load_model_config
from metrale.distributed.launch import ParallelRuntime, start_parallel
from metrale.executor.memory_plan import (CPU_DEFAULT_KV_BYTES, CUDA_RUNTIME_OVERHEAD_BYTES, MemoryPlan,
                                          MemoryPlanError, estimate_activation_bytes, fit_kv_blocks,
                                          parameter_bytes, resolve_max_num_seqs)
from metrale.executor.model_loader import build_model
from metrale.executor.model_runner import ModelRunner
from metrale.executor.multiproc_executor import MultiprocExecutor, UniprocExecutor
from metrale.models.registry import get_model_class, supported_architectures

logger = logging.getLogger(__name__)

SHIPPED_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "model_configs")


class StartupLog:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.number = 0
        self.start = time.perf_counter()

    def phase(self, name: str, detail: str = "") -> None:
        now = time.perf_counter()
        self.number += 1
        if self.enabled:
            logger.info("[%d] %-14s %7.2fs  %s", self.number, name, now - self.start, detail)
        self.start = now


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but PyTorch sees no CUDA device")
    return torch.device(name)


def resolve_model_dir(model: str | None, load_format: str) -> str:
    """A directory; `demo` (or nothing) for the built-in demo model; or, with dummy weights, the
    name of a real model whose config.json ships with met (metrale/model_configs/)."""
    if model in (None, "demo"):
        from metrale.demo import demo_model_dir

        return demo_model_dir()
    if not os.path.isdir(model) and load_format == "dummy":
        shipped = os.path.join(SHIPPED_CONFIGS, os.path.basename(model.rstrip("/")))
        if os.path.isdir(shipped):
            return shipped
    return model


def read_model_config(args: EngineArgs, device: torch.device) -> ModelConfig:
    """The model directory `args` names and its config, with `--hf-overrides` applied."""
    model_dir = resolve_model_dir(args.model, args.load_format)
    return load_model_config(model_dir, args.dtype, device, args.max_model_len, supported_architectures(),
                             args.config_overrides)


def shipped_config_names() -> list[str]:
    return sorted(os.listdir(SHIPPED_CONFIGS))


@dataclass
class EngineParts:
    model_config: ModelConfig
    tokenizer: object
    runner: ModelRunner
    plan: MemoryPlan
    max_num_seqs: int
    executor: UniprocExecutor | MultiprocExecutor  # what the engine calls execute() on


def kv_cache_dtypes(args: EngineArgs, config: ModelConfig, num_attention_layers: int) -> list[torch.dtype]:
    return [args.kv_cache_torch_dtype(i, config.dtype) for i in range(num_attention_layers)]


def plan_memory(args: EngineArgs, config: ModelConfig, device: torch.device,
                device_total: int | None = None) -> MemoryPlan:
    """The plan before loading: exact weights from a meta-device build, estimated activations."""
    with torch.device("meta"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(config.dtype)
        try:
            meta_model = get_model_class(config.architecture)(config)
        finally:
            torch.set_default_dtype(previous)
    from metrale.layers.attention.layer import Attention

    layers = [m for m in meta_model.modules() if isinstance(m, Attention)]
    kv_per_token = sum(2 * layer.num_kv_heads * layer.head_dim * dtype.itemsize
                       for layer, dtype in zip(layers, kv_cache_dtypes(args, config, len(layers))))
    activation = estimate_activation_bytes(config.hf_config, config.dtype, args.max_num_batched_tokens,
                                           1024 if args.max_num_seqs == "auto" else int(args.max_num_seqs),
                                           config.vocab_size)
    weights = parameter_bytes(meta_model)
    if device.type == "cuda" or device_total is not None:
        total = device_total if device_total is not None else torch.cuda.mem_get_info(device)[1]
        budget = int(total * args.gpu_memory_utilization)
        overhead = CUDA_RUNTIME_OVERHEAD_BYTES
        if args.kv_cache_memory is not None:
            budget = min(budget, weights + activation + overhead + args.kv_cache_memory)
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        overhead = 0
        budget = weights + activation + (args.kv_cache_memory or CPU_DEFAULT_KV_BYTES)
    seqs = 1 << 30 if args.max_num_seqs == "auto" else int(args.max_num_seqs)
    return MemoryPlan(device.type, total, budget, weights, activation, False, kv_per_token, args.block_size,
                      config.max_model_len, seqs, runtime_overhead_bytes=overhead)


def _measure_on_cuda(plan: MemoryPlan, runner: ModelRunner, args: EngineArgs, device: torch.device) -> None:
    """Replace the estimates with what the loaded model really uses."""
    rows = 1024 if args.max_num_seqs == "auto" else int(args.max_num_seqs)
    plan.activation_reserve_bytes = runner.profile_activation_bytes(args.max_num_batched_tokens, rows,
                                                                    plan.max_model_len)
    plan.activation_measured = True
    free, total = torch.cuda.mem_get_info(device)
    # Everything this process and others hold now, beyond our weights: context, workspaces.
    plan.runtime_overhead_bytes = max(0, (total - free) - plan.weight_bytes)


def _calibrate_fp8_scales(args: EngineArgs, runner: ModelRunner, tokenizer, plan: MemoryPlan) -> None:
    """Scales from the checkpoint stay; otherwise calibrate over N tokens of English text (Python's
    own documentation, offline), or keep 1.0 when N is 0."""
    if args.kv_cache_dtype != "fp8" or args.fp8_kv_calibration_tokens == 0:
        return
    if any(layer.k_scale != 1.0 or layer.v_scale != 1.0 for layer in runner.attention_layers()):
        return  # the checkpoint carried k_scale / v_scale
    n = args.fp8_kv_calibration_tokens
    if tokenizer is not None:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
        ids = tokenizer.encode(text)[:n]
    else:
        ids = [(i * 7919) % runner.model_config.vocab_size for i in range(n)]
    runner.calibrate_kv_scales(ids, args.fp8_kv_headroom, min(plan.max_model_len, plan.kv_capacity_tokens))
    logger.info("fp8 KV scales calibrated over %d tokens (headroom %.2f)", len(ids), args.fp8_kv_headroom)


def build_engine_parts(args: EngineArgs, log: StartupLog) -> EngineParts:
    device = resolve_device(args.device)
    config = read_model_config(args, device)
    model_dir = config.model_dir
    log.phase("resolve model", model_dir)

    # Above one rank: topology checks, worker ranks started, process groups (docs/parallel.md).
    parallel = start_parallel(args, config, device)
    try:
        tokenizer = load_tokenizer(args, model_dir)
        log.phase("read config", f"{config.architecture}, {config.dtype}, context {config.max_model_len}, "
                                 f"device {device}")
        if parallel is not None:
            device = parallel.device
            log.phase("parallel", parallel.topology.describe())
        runner, plan = build_runner(args, config, device, log, tokenizer, parallel)
    except BaseException:
        if parallel is not None:
            parallel.abort()
        raise
    executor = UniprocExecutor(runner) if parallel is None else MultiprocExecutor(runner, parallel)
    return EngineParts(config, tokenizer, runner, plan, plan.max_num_seqs, executor)


def _set_programmatic_launch(args: EngineArgs, device: torch.device) -> None:
    """Before any kernel is compiled or captured into a graph: the choice is baked into both."""
    from metrale.kernels import programmatic_launch_supported, set_programmatic_launch

    supported = programmatic_launch_supported(device)
    if args.programmatic_launch and not supported:
        raise ValueError("--programmatic-launch needs a CUDA GPU of compute capability 9.0 or newer and triton")
    set_programmatic_launch(supported if args.programmatic_launch is None else args.programmatic_launch)


def load_tokenizer(args: EngineArgs, model_dir: str):
    if args.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(args.tokenizer or model_dir, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {args.tokenizer or model_dir!r} ({e}); pass "
                             "--tokenizer DIR, or --skip-tokenizer-init to send token ids only") from None


def build_runner(args: EngineArgs, config: ModelConfig, device: torch.device, log: StartupLog, tokenizer,
                 parallel: ParallelRuntime | None = None) -> tuple[ModelRunner, MemoryPlan]:
    """This rank's memory plan, model, and runner with its KV cache. Every rank runs it in the same
    order: the profiling pass, the KV block agreement, calibration and graph capture meet in
    collectives."""
    _set_programmatic_launch(args, device)
    plan = plan_memory(args, config, device)
    fit_kv_blocks(plan, args.num_kv_blocks)  # refuses a model that cannot fit, before allocating
    log.phase("plan memory", f"weights {plan.weight_bytes / 2**30:.2f} GiB, KV {plan.kv_bytes_per_token} B/token")

    torch.manual_seed(args.seed)
    model = build_model(config, device, args.load_format, args.seed, show_progress=log.enabled)
    runner = ModelRunner(model, config, device, args.block_size, args.attention_backend,
                         kv_cache_dtypes(args, config, len(ModelRunner.attention_layers_of(model))))
    log.phase("load weights", f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")

    if device.type == "cuda":
        _measure_on_cuda(plan, runner, args, device)
    _fit_kv_blocks_on_every_rank(plan, args, parallel)
    plan.max_num_seqs = resolve_max_num_seqs(args.max_num_seqs, plan.kv_capacity_tokens, plan.max_model_len)
    runner.allocate_kv_cache(plan.num_kv_blocks)
    _calibrate_fp8_scales(args, runner, tokenizer, plan)
    if not args.enforce_eager:
        runner.capture_cuda_graphs(plan.max_num_seqs, plan.max_model_len)
    log.phase("size KV cache", f"{plan.num_kv_blocks} blocks x {args.block_size} tokens "
                               f"({plan.kv_cache_bytes / 2**20:.0f} MiB), attention backend {runner.backend.name}")
    if device.type == "cuda" and runner.backend.name == "triton":
        from metrale.executor.kernel_warmup import warm_up_kernels

        warm_up_kernels(runner, plan.max_num_seqs)  # the same forwards on every rank (collectives)
        log.phase("warm up kernels", "Triton variants of the first steps compiled")
    if log.enabled:
        logger.info("%s", plan.table())
    return runner, plan


def _fit_kv_blocks_on_every_rank(plan: MemoryPlan, args: EngineArgs, parallel: ParallelRuntime | None) -> None:
    """Rank 0's scheduler hands out block ids that every rank's pool must hold: all ranks take the
    smallest count any of them fits (a rank that cannot fit at all sends 0 and stops them all)."""
    if parallel is None:
        fit_kv_blocks(plan, args.num_kv_blocks)
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
