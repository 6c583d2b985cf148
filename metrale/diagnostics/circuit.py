"""`met circuit diff`: which layer of a checkpoint first disagrees with transformers.

It builds met's engine through the normal startup (the flags of `met generate`), prefills the
prompts in one go through the engine's step loop (schedule -> execute -> update, every prompt a
request of one batch), and records the taps of taps.py on the way. transformers' model of the
same checkpoint (AutoModelForCausalLM, trust_remote_code=False, met's dtype and rank 0's device)
runs each prompt alone, the same taps hooked. report.py compares them request by request and
names the first tap past the tolerance. Exit status: 0 all within, 1 a tap diverges, 2 the
comparison could not run (like diff(1)).

This module imports no torch at the top: `met --help` builds its parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from metrale.config.engine_args import EngineArgs
from metrale.config.errors import StartupError

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog."
# GPU memory the KV pool may take unless --kv-cache-memory or --num-kv-blocks says otherwise: the
# prompts need little, and transformers' copy of the model shares the device.
KV_CACHE_BYTES = 1 << 30


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("a prompt needs at least one token id")
    return ids


def add_circuit_parser(subparsers) -> None:
    """`met circuit diff`, under the `met` command's subparsers."""
    circuit = subparsers.add_parser("circuit", help="compare met's forward pass with a reference, layer by layer")
    sub = circuit.add_subparsers(dest="circuit", required=True)
    diff = sub.add_parser("diff", formatter_class=circuit.formatter_class,
                          help="name the first tap (embeddings, residual stream after each block, final norm, "
                               "logits) where met's forward and transformers' disagree")
    diff.add_argument("--prompt", action="append", default=None,
                      help="a prompt text; repeat for a batch of several requests (default: one built-in sentence)")
    diff.add_argument("--prompt-token-ids", action="append", type=_token_ids, default=None, metavar="IDS",
                      help="a prompt as comma-separated token ids, e.g. 1,2,3; repeatable, after the --prompt texts")
    diff.add_argument("--json", action="store_true", help="print the report as JSON")
    diff.add_argument("--tolerance", type=float, default=None,
                      help="the largest max rel diff (max|met - ref| / max|ref|) a tap may have (default: per dtype, "
                           "1e-4 for float32, 5e-2 for bfloat16)")
    diff.add_argument("--min-cosine", type=float, default=None,
                      help="the lowest cosine similarity of a token's row a tap may have (default: per dtype, "
                           "0.99999 for float32, 0.995 for bfloat16)")
    EngineArgs.add_cli_args(diff)
    diff.set_defaults(handler=run)


def circuit_engine_args(args: EngineArgs, num_prompts: int = 1) -> EngineArgs:
    """The engine for a diff: every prompt token computed (no prefix-cache hit may skip a row), no
    graph capture (only the prefill runs, and it runs eager anyway), a small KV pool, and room
    for every prompt in one batch."""
    changes = dict(enable_prefix_caching=False, enforce_eager=True)
    if args.kv_cache_memory is None and args.num_kv_blocks is None:
        changes["kv_cache_memory"] = KV_CACHE_BYTES
    if args.max_num_seqs == EngineArgs.max_num_seqs:  # the default: sized for serving, not for a few prompts
        changes["max_num_seqs"] = max(1, num_prompts)
    return dataclasses.replace(args, **changes)


def circuit_diff(engine, prompts: list[list[int]], max_rel: float | None = None, min_cosine: float | None = None):
    """Prefill `prompts` on `engine` (an LLMEngine, idle) with the taps recorded, run transformers'
    model of the same checkpoint on each, and return the CircuitReport."""
    from metrale.diagnostics.report import CircuitReport, Tolerance, compare_taps
    from metrale.diagnostics.taps import MetTaps, ReferenceTaps
    from metrale.messages.sampling_params import SamplingParams

    config = engine.model_config
    request_ids = [f"circuit-{i}" for i in range(len(prompts))]
    taps = MetTaps(engine.runner.model, {rid: len(ids) for rid, ids in zip(request_ids, prompts)})
    executor = engine.executor
    engine.executor = _PlanOrder(executor, taps.begin_step)
    try:
        with taps.installed():
            for rid, ids in zip(request_ids, prompts):
                engine.add_request(rid, {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.executor = executor
    ours = taps.collect()

    reference = load_reference(config.model_dir, config.dtype, engine.device, engine.args.config_overrides)
    reference_taps = ReferenceTaps(reference, taps.mixer_names)
    theirs = [reference_taps.run(ids) for ids in prompts]
    del reference

    dtype = str(config.dtype).removeprefix("torch.")
    tolerance = Tolerance.for_dtype(dtype, max_rel, min_cosine)
    source = f"{dtype} defaults" if max_rel is None and min_cosine is None else "given"
    rows = compare_taps(taps.names, [ours[rid] for rid in request_ids], theirs)
    return CircuitReport(config.model_dir, config.architecture, dtype, str(engine.device), engine.args.tp_size,
                         [len(ids) for ids in prompts], tolerance, source, rows)


class _PlanOrder:
    """The engine's executor, telling `begin_step` each plan's request order (the runner's row
    order) before the step runs; everything else is the executor's."""

    def __init__(self, executor, begin_step):
        self._executor, self._begin_step = executor, begin_step

    def execute_async(self, plan):
        self._begin_step(plan.num_scheduled_tokens)
        return self._executor.execute_async(plan)

    def __getattr__(self, name: str):
        return getattr(self._executor, name)


def load_reference(model_dir: str, dtype, device, config_overrides: dict | None = None):
    """transformers' model of the checkpoint, in met's dtype on met's (rank 0's) device, with the
    same --hf-overrides. A block-FP8 checkpoint is compared on its dequantized weights (what met
    computes without activation quantization; transformers' own FP8 path needs a GPU and
    accelerate): `dequantized_checkpoint` writes that copy first."""
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    for name, value in (config_overrides or {}).items():
        setattr(hf_config, name, value)
    quantization = getattr(hf_config, "quantization_config", None)
    with tempfile.TemporaryDirectory(prefix="met-dequantized-") as scratch:
        if quantization:
            model_dir = dequantized_checkpoint(model_dir, scratch, quantization)
            hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
            for name, value in (config_overrides or {}).items():
                setattr(hf_config, name, value)
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=hf_config, dtype=dtype,
                                                     trust_remote_code=False)
    return model.to(device).eval()


def dequantized_checkpoint(model_dir: str, scratch: str, quantization: dict) -> str:
    """A copy of a block-FP8 checkpoint in `scratch` with every FP8 weight multiplied out by its
    `weight_scale_inv` (float32) and no quantization_config."""
    import os

    from safetensors.torch import save_file

    from metrale.config.quantization import resolve_quantization
    from metrale.kernels.fp8_math import FP8_DTYPE, dequantize_weight
    from metrale.loader.safetensors_loader import iterate_tensors

    fp8 = resolve_quantization(quantization, None, "none", model_dir)  # refuses what met cannot read
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(os.path.join(scratch, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    tensors = dict(iterate_tensors(model_dir))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == FP8_DTYPE:
            tensor = dequantize_weight(tensor, tensors[f"{name}_scale_inv"], fp8.block_n, fp8.block_k)
        out[name] = tensor
    save_file(out, os.path.join(scratch, "model.safetensors"), metadata={"format": "pt"})  # one file
    return scratch


def run(args: argparse.Namespace) -> int:
    """The `met circuit diff` command: the report on stdout, the exit status (0, 1, 2)."""
    from metrale.diagnostics.taps import TapError
    from metrale.distributed.launch import topology_from_args
    from metrale.messages.errors import InvalidRequestError
    from metrale.startup import build_llm_engine

    texts = args.prompt or ([] if args.prompt_token_ids else [DEFAULT_PROMPT])
    id_prompts = args.prompt_token_ids or []
    try:
        engine_args = circuit_engine_args(EngineArgs.from_cli_args(args), len(texts) + len(id_prompts))
        topology, _ = topology_from_args(engine_args)
        if topology.rank != 0:  # a rank torchrun started: follow rank 0's steps
            from metrale.startup.worker_rank import run_worker

            return run_worker(engine_args)
        engine = build_llm_engine(engine_args)
    except StartupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        prompts = [engine.tokenize(text)[1] for text in texts] + id_prompts
        report = circuit_diff(engine, prompts, args.tolerance, args.min_cosine)
    except (InvalidRequestError, TapError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    quantization = engine.model_config.quantization
    if quantization is not None and quantization.activation_group is not None and report.exit_status:
        print("note: the model runs FP8 with its activations quantized (W8A8), and transformers runs its "
              "dequantized weights without that: differences of about 1e-2 from the first layer on are the "
              "activation quantization. --activation-quantization none compares like for like.", file=sys.stderr)
    return report.exit_status
