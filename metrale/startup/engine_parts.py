"""Startup, in its phases: resolve the model, read the config, plan memory, load the weights,
size the KV cache. Each phase is logged with the time it took. This is the composition root:
the only place that assembles the executor, the runner and the engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from metrale.config.cache_config import CacheConfig
from metrale.config.engine_args import EngineArgs
from metrale.config.model_config import ModelConfig
from metrale.distributed.launch import ParallelRuntime
from metrale.engine.engine import LLMEngine
from metrale.executor.kernel_warmup import warm_up_kernels
from metrale.executor.memory_plan import MemoryPlan, fit_kv_blocks
from metrale.executor.model_loader import build_model
from metrale.executor.model_runner import ModelRunner
from metrale.executor.multiproc_executor import MultiprocExecutor, UniprocExecutor
from metrale.kernels import programmatic_launch_supported, set_programmatic_launch
from metrale.startup.cpu_threads import set_cpu_threads
from metrale.startup.memory import calibrate_fp8_scales, fit_kv_blocks_on_every_rank, measure_on_cuda, plan_memory
from metrale.startup.model_source import load_tokenizer, read_model_config, resolve_device
from metrale.startup.parallel import start_parallel
from metrale.startup.phases import StartupLog

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    model_config: ModelConfig
    tokenizer: object
    runner: ModelRunner
    plan: MemoryPlan
    max_num_seqs: int
    executor: UniprocExecutor | MultiprocExecutor  # what the engine calls execute() on


def build_engine_parts(args: EngineArgs, log: StartupLog, reserved_cores: int = 0) -> EngineParts:
    """`reserved_cores`: CPU cores the caller keeps for its own threads (a server's event loop)."""
    device = resolve_device(args.device)
    config = read_model_config(args, device)
    model_dir = config.model_dir
    log.phase("resolve model", model_dir)

    # Above one rank: topology checks, worker ranks started, process groups (docs/parallel.md).
    parallel = start_parallel(args, config, device)
    if device.type == "cpu":  # the ranks this process started compute beside it
        set_cpu_threads(reserved_cores, ranks=1 + len(parallel.workers) if parallel is not None else 1)
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
    supported = programmatic_launch_supported(device)
    if args.programmatic_launch and not supported:
        raise ValueError("--programmatic-launch needs a CUDA GPU of compute capability 9.0 or newer and triton")
    set_programmatic_launch(supported if args.programmatic_launch is None else args.programmatic_launch)


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
    runner = ModelRunner(model, config, device, CacheConfig.from_args(args, config.dtype), args.attention_backend)
    log.phase("load weights", f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    if runner.layout.has_state:
        logger.info("linear-attention recurrent state dtype: %s (--ssm-h-dtype)", args.ssm_h_dtype)

    if device.type == "cuda":
        measure_on_cuda(plan, runner, args, device)
    fit_kv_blocks_on_every_rank(plan, args, parallel)
    runner.allocate_caches(plan.num_kv_blocks, plan.num_state_slots)
    calibrate_fp8_scales(args, runner, tokenizer, plan)
    if not args.enforce_eager:
        runner.capture_cuda_graphs(plan.max_num_seqs, plan.max_model_len)
    state = f", {plan.num_state_slots + 1} state slots ({plan.state_cache_bytes / 2**20:.0f} MiB)" \
        if plan.state_bytes_per_slot else ""
    log.phase("size KV cache", f"{plan.num_kv_blocks} blocks x {args.block_size} tokens "
                               f"({plan.kv_cache_bytes / 2**20:.0f} MiB){state}, backends {runner.backend_names}")
    if device.type == "cuda" and any(b.name == "triton" for b in runner.backends.values()):
        warm_up_kernels(runner, plan.max_num_seqs)  # the same forwards on every rank (collectives)
        log.phase("warm up kernels", "Triton variants of the first steps compiled")
    if log.enabled:
        logger.info("%s", plan.table())
    return runner, plan


def build_llm_engine(args: EngineArgs, log_startup: bool = False, reserved_cores: int = 0) -> LLMEngine:
    """Every startup phase, then the engine over the parts."""
    log = StartupLog(log_startup)
    return LLMEngine(args, build_engine_parts(args, log, reserved_cores), log)
