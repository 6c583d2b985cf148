"""The `met` command: generate, serve, bench, memory-plan."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from metrale.config.engine_args import EngineArgs
from metrale.config.errors import OptionError, StartupError, show_tracebacks


def _follow_rank_0(engine_args: EngineArgs) -> int | None:
    """A non-zero rank (--rank R, or torchrun's RANK) runs rank 0's step plans instead of the
    command; returns its exit status, or None on rank 0."""
    from metrale.distributed.launch import topology_from_args

    topology, _ = topology_from_args(engine_args)
    if topology.rank == 0:
        return None
    from metrale.startup.worker_rank import run_worker

    return run_worker(engine_args)


def _generate(args: argparse.Namespace) -> int:
    from metrale.messages.errors import InvalidRequestError
    from metrale.entrypoints.llm import LLM
    from metrale.messages.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    worker_status = _follow_rank_0(engine_args)
    if worker_status is not None:
        return worker_status
    llm = LLM(**vars(engine_args))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed_sampling)
        out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out.outputs[0].text)
    return 0


def _memory_plan(args: argparse.Namespace) -> int:
    import torch

    from metrale.distributed.launch import shard_sizes_of, topology_from_args
    from metrale.startup.memory import plan_memory
    from metrale.startup.model_source import read_model_config, resolve_device
    from metrale.executor.memory_plan import MemoryPlanError, fit_kv_blocks, resolve_max_num_seqs

    engine_args = EngineArgs.from_cli_args(args)
    device_total = int(args.device_memory_gib * 2**30) if args.device_memory_gib else None
    device = torch.device("cuda") if device_total else resolve_device(engine_args.device)
    config = read_model_config(engine_args, device)
    topology, _ = topology_from_args(engine_args)
    with shard_sizes_of(topology, engine_args.moe_expert_layout):  # rank 0's shard when split
        plan = plan_memory(engine_args, config, device, device_total)
    if topology.world_size > 1:
        plan.notes.append(f"per rank: rank 0 of {topology.describe()}")
    try:
        fit_kv_blocks(plan, engine_args.num_kv_blocks)
    except MemoryPlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    plan.max_num_seqs = resolve_max_num_seqs(engine_args.max_num_seqs, plan.kv_capacity_tokens, plan.max_model_len)
    print(plan.table())
    print("  (activation reserve estimated; `met serve` measures it on the GPU after loading the weights)")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import os

    from metrale.bench import latency, throughput
    from metrale.startup.model_source import resolve_model_dir
    from metrale.entrypoints.llm import LLM

    if args.bench == "serve":
        from metrale.bench import serve

        serve.run(args)
        return 0
    engine_args = EngineArgs.from_cli_args(args)
    model_dir = resolve_model_dir(engine_args.model, engine_args.load_format)
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        engine_args.skip_tokenizer_init = True  # benchmarks send token ids; a config-only model has no tokenizer

    def llm_factory():
        return LLM(**vars(engine_args))

    {"latency": latency, "throughput": throughput}[args.bench].run(args, llm_factory)
    return 0


def _spec_cost_table(args: argparse.Namespace) -> int:
    from metrale.bench import spec_cost_table
    from metrale.entrypoints.llm import LLM

    spec_cost_table.run(args, lambda engine_args: LLM(**vars(engine_args)))
    return 0


def _check_kernels(args: argparse.Namespace) -> int:
    """`met serve --check-kernels`: startup through the kernel audit, then its report; the exit
    status is the number of variants that cannot be built."""
    import os

    import torch

    if args.device == "cpu" or not torch.cuda.is_available():
        # Before any kernel module is imported: @triton.jit reads it when it decorates.
        os.environ["TRITON_INTERPRET"] = "1"
        args.device = "cpu"
        if args.forward == "auto":
            args.forward = "eager"  # the Triton kernels, interpreted
    from metrale.executor.kernel_audit import KernelBuildError
    from metrale.startup import StartupLog, build_engine_parts

    engine_args = EngineArgs.from_cli_args(args)
    try:
        parts = build_engine_parts(engine_args, StartupLog(True))
    except KernelBuildError as e:
        print(e.report.table())
        return min(len(e.report.unresolved), 255)
    print(parts.runner.kernel_report.table())
    parts.executor.shutdown()
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.check_kernels:
        return _check_kernels(args)
    # The first line comes at once, before the imports of torch and the server (seconds).
    host = f"[{args.host}]" if ":" in args.host else args.host
    logging.getLogger("metrale.serve").info(
        "met serve: starting %s on http://%s:%d; each startup phase is logged as it ends",
        "the built-in demo model" if args.model in (None, "demo") else repr(args.model), host, args.port)
    started = time.perf_counter()
    from metrale.entrypoints.server.app import run_server
    from metrale.startup.phases import log_imports

    log_imports(time.perf_counter() - started)

    worker_status = _follow_rank_0(EngineArgs.from_cli_args(args))
    return worker_status if worker_status is not None else run_server(args)


class DefaultsShown(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default in (None, argparse.SUPPRESS)
                or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """Every parser of `met` (subcommands are built with the parent's class): defaults shown in
    the help, and --debug."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", help="Print the traceback of startup errors too")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line. Building it imports nothing heavy (no torch, no transformers):
    `met --help` and `met serve --help` answer at once."""
    parser = CommandParser(prog="met", description="met: LLM inference engine and OpenAI-compatible server")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", dest="seed_sampling", type=int, default=None, help="sampling seed of the request")
    EngineArgs.add_cli_args(gen, skip=("seed",))
    gen.set_defaults(handler=_generate)

    mem = sub.add_parser("memory-plan", help="print the startup memory plan without loading anything")
    mem.add_argument("--device-memory-gib", type=float, default=None,
                     help="plan for a GPU of this size (default: this machine's device)")
    EngineArgs.add_cli_args(mem)
    mem.set_defaults(handler=_memory_plan)

    bench = sub.add_parser("bench", help="benchmarks, each beside the hardware floor of its run")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from metrale.bench import latency, throughput

    for name, module in (("latency", latency), ("throughput", throughput)):
        p = bench_sub.add_parser(name, help=module.__doc__.splitlines()[0])
        module.add_args(p)
        EngineArgs.add_cli_args(p)
        p.set_defaults(handler=_bench)
    from metrale.bench import serve as serve_bench

    p = bench_sub.add_parser("serve", help=serve_bench.__doc__.splitlines()[0])
    serve_bench.add_args(p)
    p.set_defaults(handler=_bench)
    from metrale.bench import spec_cost_table

    # `met benchmark spec-cost-table` (issue 17's name) and `met bench spec-cost-table` are one command.
    benchmark = sub.add_parser("benchmark", help="calibration benchmarks (spec-cost-table)")
    benchmark_sub = benchmark.add_subparsers(dest="benchmark", required=True)
    for subparsers in (bench_sub, benchmark_sub):
        p = subparsers.add_parser("spec-cost-table", help=spec_cost_table.__doc__.splitlines()[0])
        spec_cost_table.add_args(p)
        EngineArgs.add_cli_args(p)
        p.set_defaults(handler=_spec_cost_table)

    from metrale.entrypoints.server.args import add_serve_args

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(serve)
    EngineArgs.add_cli_args(serve)
    serve.set_defaults(handler=_serve)

    from metrale.diagnostics.circuit import add_circuit_parser

    add_circuit_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    args = build_parser().parse_args(argv)
    show_tracebacks(args.debug)
    try:
        return args.handler(args) or 0
    except StartupError as e:  # the message says what to do; a traceback would bury it
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, OptionError) else 1


if __name__ == "__main__":
    sys.exit(main())
