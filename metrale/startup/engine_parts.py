"""Startup, in its fixed phases (phases.py): model resolve, configure, backend, topology,
weights, KV cache, kernel audit. Each phase is logged with the time it took. This is the composition root:
the only place that assembles the executor, the runner and the engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from metrale.config.cache_config import CacheConfig
from metrale.config.engine_args import EngineArgs
from metrale.config.model_config import ModelConfig
from metrale.distributed.gather import gather_dicts
from metrale.distributed.launch import ParallelRuntime
from metrale.engine.engine import LLMEngine
from metrale.executor.drafters import build_drafter
from metrale.executor.kernel_audit import build_error, kernel_audit, run_audited
from metrale.executor.kernel_warmup import warm_up_steps
from metrale.executor.memory_plan import MemoryPlan, fit_kv_blocks, rank_memory
from metrale.executor.model_loader import build_model
from metrale.executor.model_runner import ModelRunner
from metrale.executor.multiproc_executor import MultiprocExecutor, UniprocExecutor
from metrale.kernels import programmatic_launch_supported, set_programmatic_launch
from metrale.startup.cpu_threads import set_cpu_threads
from metrale.startup.memory import (apply_lm_head_dtype, calibrate_fp8_scales, fit_kv_blocks_on_every_rank,
                                    measure_on_cuda, plan_memory)
from metrale.config.host import resident_bytes
from metrale.startup.model_source import (check_activation, load_tokenizer, read_model_config, resolve_device,
                                          resolve_forward, sampled_vocab_size, vocabulary_note)
from metrale.startup.parallel import ranks_started_here, start_parallel
from metrale.startup.phases import StartupLog
from metrale.structured.grammars import GrammarCache

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    model_config: ModelConfig
    tokenizer: object
    runner: ModelRunner
    plan: MemoryPlan
    max_num_seqs: int
    executor: UniprocExecutor | MultiprocExecutor  # what the engine calls execute() on


@dataclass
class Prepared:
    """What phases 1 to 4 leave for the rest of startup, on every rank."""

    device: torch.device
    config: ModelConfig
    tokenizer: object
    parallel: ParallelRuntime | None
    host_baseline_bytes: int | None  # resident host memory before any backend existed


def prepare(args: EngineArgs, log: StartupLog, reserved_cores: int = 0, spawned: bool = False) -> Prepared:
    """Phases 1-4, the same on every rank: the model, its configuration, the backend (and the
    host-memory baseline), the topology (other ranks joined, or started)."""
    baseline = resident_bytes()  # before the first backend exists: GET /memory's footprint is against it
    device = resolve_device(args.device)
    config = read_model_config(args, device)
    log.phase("model resolve", f"{config.model_dir}: {config.architecture}")

    check_activation(config)
    tokenizer = load_tokenizer(args, config.model_dir)
    log.phase("configure", f"{config.dtype}, context {config.max_model_len}, {vocabulary_note(config, tokenizer)}")

    if device.type == "cpu":
        threads = set_cpu_threads(reserved_cores, ranks_started_here(args, spawned))
        backend = f"cpu, {threads} thread(s)"
    else:
        backend = f"cuda, {torch.cuda.device_count()} GPU(s) visible"  # no context yet: ranks pick theirs next
    host = f"host memory baseline {baseline / 2**20:,.0f} MiB resident" if baseline else "host memory unknown"
    log.phase("backend", f"{backend}; {host}")

    # Above one rank: topology checks, worker ranks started, process groups (docs/parallel.md).
    parallel = start_parallel(args, config, device, spawned=spawned)
    log.phase("topology", parallel.topology.describe() if parallel is not None else "1 rank")
    return Prepared(parallel.device if parallel is not None else device, config, tokenizer, parallel, baseline)


def report_ranks(ready: Prepared, runner: ModelRunner, plan: MemoryPlan) -> list[dict]:
    """Every rank's memory at the end of startup, gathered on every rank (all ranks call this at
    the same point: rank 0 in build_engine_parts, the workers in build_worker)."""
    rss = resident_bytes()
    mine = dict(rank_memory(runner, plan), rank=ready.parallel.topology.rank, host_rss_bytes=rss,
                host_baseline_rss_bytes=ready.host_baseline_bytes)
    return gather_dicts(ready.parallel.control_group, mine)


def build_engine_parts(args: EngineArgs, log: StartupLog, reserved_cores: int = 0) -> EngineParts:
    """`reserved_cores`: CPU cores the caller keeps for its own threads (a server's event loop)."""
    ready = prepare(args, log, reserved_cores)
    try:
        runner, plan = build_runner(args, ready.config, ready.device, log, ready.tokenizer, ready.parallel)
    except BaseException:
        if ready.parallel is not None:
            ready.parallel.abort()
        raise
    plan.host_baseline_bytes = ready.host_baseline_bytes
    parallel = ready.parallel
    if parallel is not None:
        plan.ranks = report_ranks(ready, runner, plan)
    executor = UniprocExecutor(runner) if parallel is None else MultiprocExecutor(runner, parallel)
    return EngineParts(ready.config, ready.tokenizer, runner, plan, plan.max_num_seqs, executor)


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

    torch.manual_seed(args.seed)
    model = build_model(config, device, args.load_format, args.seed, show_progress=log.enabled)
    apply_lm_head_dtype(model, args)
    forward = resolve_forward(args, device)
    backend = args.attention_backend
    if args.forward == "reference":  # asked for, not the CPU's default
        backend = "torch"
    elif forward == "eager" and device.type == "cpu" and backend == "auto":  # the interpreter (checks)
        backend = "kernels"  # Triton for every kind that has it
    drafter = build_drafter(args.speculative_decoding, model, config.max_model_len, args.block_size,
                            args.schedules_asynchronously(device.type))
    runner = ModelRunner(model, config, device, CacheConfig.from_args(args, config.dtype), backend, forward=forward,
                         drafter=drafter)
    runner.sampled_vocab_size = sampled_vocab_size(config, tokenizer)
    if tokenizer is not None:  # every rank: each compiles the grammars of the requests it samples
        runner.attach_grammars(GrammarCache(tokenizer, runner.sampled_vocab_size or config.vocab_size,
                                            args.structured_outputs_timeout))
    weight_format = f", {plan.weight_format}" if plan.weight_format else ""
    log.phase("weights", f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
                         f"{plan.weight_bytes / 2**30:.2f} GiB{weight_format}")
    if runner.layout.has_state:
        logger.info("linear-attention recurrent state dtype: %s (--ssm-h-dtype)", args.ssm_h_dtype)

    # The audit records every Triton launch from the first forward on (phases 6 and 7).
    with kernel_audit() as report:
        try:
            _size_caches(args, plan, runner, tokenizer, parallel, forward, log)
            if forward != "reference":
                # the same forwards on every rank (collectives); a step that cannot build its kernels
                # is recorded and the others still run, so the report lists every failure
                with runner.kernel_context(), torch.inference_mode():
                    run_audited(report, warm_up_steps(runner, plan.max_num_seqs,
                                                      args.step_token_budget(runner.device.type),
                                                      args.schedules_asynchronously(runner.device.type)))
        except Exception as launch_error:
            if not report.unresolved:
                raise
            raise build_error(report) from launch_error
    if report.unresolved:  # a failed step whose error run_audited recorded and let pass
        raise build_error(report)
    runner.kernel_report = report
    log.phase("kernel audit", f"forward {forward}: {report.summary()}")
    if log.enabled:
        logger.info("%s", plan.table())
    return runner, plan


def _size_caches(args, plan, runner, tokenizer, parallel, forward: str, log: StartupLog) -> None:
    """Phase 6: measured activations (CUDA), the KV pool and state slots agreed and allocated,
    fp8 scales, CUDA graphs."""
    if runner.device.type == "cuda":
        measure_on_cuda(plan, runner, args, runner.device)
    fit_kv_blocks_on_every_rank(plan, args, parallel)
    runner.allocate_caches(plan.num_kv_blocks, plan.num_state_slots, plan.draft_slots_per_seq, plan.max_num_seqs)
    calibrate_fp8_scales(args, runner, tokenizer, plan)
    if forward == "graphs":
        spec = args.speculative_decoding
        budget = args.step_token_budget(runner.device.type)
        runner.capture_cuda_graphs(plan.max_num_seqs, plan.max_model_len, budget,
                                   spec.num_speculative_tokens if spec is not None else 0,
                                   budget if args.prefill_graphs else 0)
    state = f", {runner.caches.num_slots} state slots ({plan.state_cache_bytes / 2**20:.0f} MiB)" \
        if plan.state_bytes_per_slot else ""
    log.phase("kv cache", f"{plan.num_kv_blocks} blocks x {args.block_size} tokens "
                          f"({plan.kv_cache_bytes / 2**20:.0f} MiB, {plan.kv_bytes_per_token} B/token){state}, "
                          f"backends {runner.backend_names}")


def build_llm_engine(args: EngineArgs, log_startup: bool = False, reserved_cores: int = 0) -> LLMEngine:
    """Every startup phase, then the engine over the parts."""
    log = StartupLog(log_startup)
    return LLMEngine(args, build_engine_parts(args, log, reserved_cores), log)
