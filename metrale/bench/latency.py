"""`met bench latency`: time to first token and per-token decode latency of one batch."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np

from metrale.messages.sampling_params import SamplingParams


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--output-json", default=None)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), numpy's linear interpolation between the nearest ranks: the
    50th is the median; of fewer than ten values the 99th is 92% or more of the way to the max."""
    return float(np.percentile(values, q))


def summarize(values: list[float], name: str) -> dict:
    """`{name}_p50_s`, `_p99_s`, `_min_s`, `_max_s` of the per-iteration values."""
    return {f"{name}_p50_s": percentile(values, 50), f"{name}_p99_s": percentile(values, 99),
            f"{name}_min_s": min(values), f"{name}_max_s": max(values)}


def few_iterations_warning(num_iters: int) -> str | None:
    if num_iters >= 10:
        return None
    return (f"  warning: p99 of {num_iters} iteration{'s' if num_iters != 1 else ''} is the max, near enough; "
            "pass --num-iters 10 or more for a tail")


def _spread_line(label: str, stats: dict, name: str, digits: int) -> str:
    ms = {k: stats[f"{name}_{k}_s"] * 1e3 for k in ("p50", "p99", "min", "max")}
    return (f"  {label:<21} p50 {ms['p50']:.{digits}f}  p99 {ms['p99']:.{digits}f}  "
            f"min {ms['min']:.{digits}f}  max {ms['max']:.{digits}f} ms")


def _one_batch(engine, prompts, output_len, tag) -> tuple[float, list[float]]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    token_times: list[float] = []
    while engine.has_unfinished_requests():
        if engine.step():
            token_times.append(time.perf_counter() - start)
    return token_times[0], token_times


def run(args: argparse.Namespace, llm_factory) -> dict:
    # Here, not at the top: `met --help` imports this module and must not import torch.
    from metrale.bench.hardware import decode_floor, measure, prefill_floor
    from metrale.bench.workload import run_settings, weights_read_per_step

    llm = llm_factory()
    engine = llm.llm_engine
    rates = measure(engine.device)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def batch():
        return [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)]

    for i in range(args.num_iters_warmup):
        _one_batch(engine, batch(), args.output_len, f"warmup{i}")
    ttfts, tpots = [], []
    for i in range(args.num_iters):
        ttft, times = _one_batch(engine, batch(), args.output_len, f"iter{i}")
        ttfts.append(ttft)
        # A verify step gives several tokens: per token, not per step, when speculating.
        num_intervals = (args.output_len if engine.scheduler.drafter is not None else len(times)) - 1
        tpots.append((times[-1] - times[0]) / max(1, num_intervals))
    model = engine.runner.model
    step_bytes, step_params = weights_read_per_step(model, args.batch_size)
    kv, state = engine.memory_plan.kv_bytes_per_token, engine.memory_plan.state_bytes_per_slot
    decode_steps = [[args.input_len + t] * args.batch_size for t in range(1, args.output_len)]
    decode = decode_floor(step_bytes, step_params, kv, decode_steps, rates, state)
    prefill = prefill_floor(step_bytes, step_params, [args.input_len] * args.batch_size, rates, state)
    tpot = statistics.median(tpots)
    ttft = statistics.median(ttfts)
    floor_tpot = decode.seconds / len(decode_steps)
    result = {
        "benchmark": "latency", **run_settings(engine), "batch_size": args.batch_size, "input_len": args.input_len,
        "output_len": args.output_len, "device": rates.device,
        "ttft_s": ttft, "tpot_s": tpot, "ttft_per_iter_s": ttfts, "tpot_per_iter_s": tpots,
        "floor_ttft_s": prefill.seconds, "floor_tpot_s": floor_tpot,
        "tpot_floor_ratio": floor_tpot / tpot, "decode_bound": decode.bound,
        "bandwidth_tb_s": rates.bandwidth_bytes_per_s / 1e12, "matmul_tflops": rates.matmul_flops_per_s / 1e12,
        "weight_bytes_per_step": step_bytes, "state_bytes_per_seq": state,
        **summarize(ttfts, "ttft"), **summarize(tpots, "tpot"),
    }
    print(rates.describe())
    print(f"batch {args.batch_size}, input {args.input_len}, output {args.output_len}:")
    print(f"  time to first token   {ttft * 1e3:9.2f} ms   (floor {prefill.seconds * 1e3:.2f} ms, {prefill.bound}-bound)")
    print(f"  decode per token      {tpot * 1e3:9.3f} ms   (floor {floor_tpot * 1e3:.3f} ms: "
          f"{step_bytes / 1e9:.2f} GB weights + KV" + (f" + {2 * state * args.batch_size / 1e9:.2f} GB state"
                                                         if state else "") + " per step over the measured bandwidth)")
    print(f"  achieved / floor      {floor_tpot / tpot:9.1%}")
    print(f"  over {args.num_iters} iteration{'s' if args.num_iters != 1 else ''}:")
    print(_spread_line("time to first token", result, "ttft", 2))
    print(_spread_line("decode per token", result, "tpot", 3))
    warning = few_iterations_warning(args.num_iters)
    if warning:
        print(warning)
    spec = engine.scheduler.stats().spec_decode
    if spec is not None:  # counted over warm-up and measured iterations alike
        result.update(spec_acceptance_rate=spec.acceptance_rate, spec_mean_accepted_length=spec.mean_accepted_length,
                      spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
                      spec_num_accepted_tokens=spec.num_accepted_tokens)
        print(f"  speculative decoding  acceptance {spec.acceptance_rate:.1%} of {spec.num_draft_tokens} draft tokens, "
              f"mean accepted length {spec.mean_accepted_length:.2f} tokens per verify step")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
