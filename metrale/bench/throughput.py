"""`met bench throughput`: an offline batch, output and total tokens per second."""

from __future__ import annotations

import argparse
import json
import time



def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", choices=("random",), default="random")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len-range", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def run(args: argparse.Namespace, llm_factory) -> dict:
    # Here, not at the top: `met --help` imports this module and must not import torch.
    from metrale.bench.hardware import measure, offline_floor
    from metrale.bench.workload import random_workload, run_settings, step_weight_bytes, weights_read_per_step

    workload = random_workload(args.num_prompts, tuple(args.input_len_range), tuple(args.output_len_range),
                               args.dataset_seed)
    llm = llm_factory()
    engine = llm.llm_engine
    rates = measure(engine.device)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], workload.params[0].clone(max_tokens=8), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], workload.params)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    input_tokens = sum(workload.input_lens)
    assert output_tokens == sum(workload.output_lens), "ignore_eos: every request runs to max_tokens"
    _, active_params = weights_read_per_step(engine.runner.model, 1)
    floor = offline_floor(step_weight_bytes(engine.runner.model), active_params,
                          engine.memory_plan.kv_bytes_per_token, workload.input_lens, workload.output_lens, rates,
                          engine.memory_plan.state_bytes_per_slot)
    result = {
        "benchmark": "throughput", **run_settings(engine), "num_prompts": args.num_prompts, "device": rates.device,
        "seconds": seconds, "output_tokens": output_tokens, "input_tokens": input_tokens,
        "output_tokens_per_s": output_tokens / seconds, "total_tokens_per_s": (output_tokens + input_tokens) / seconds,
        "requests_per_s": args.num_prompts / seconds, "floor_seconds": floor.seconds,
        "floor_output_tokens_per_s": output_tokens / floor.seconds, "floor_ratio": floor.seconds / seconds,
        "bound": floor.bound, "num_preemptions": engine.scheduler.num_preemptions_total,
        "bandwidth_tb_s": rates.bandwidth_bytes_per_s / 1e12, "matmul_tflops": rates.matmul_flops_per_s / 1e12,
        "kv_cache_dtype": engine.args.kv_cache_dtype, "kv_capacity_tokens": engine.memory_plan.kv_capacity_tokens,
    }
    print(rates.describe())
    print(f"{args.num_prompts} requests, {input_tokens} prompt + {output_tokens} output tokens in {seconds:.2f} s")
    print(f"  output tokens/s   {result['output_tokens_per_s']:10.1f}   (floor {result['floor_output_tokens_per_s']:.0f}, "
          f"{floor.bound}-bound: {floor.bytes_moved / 1e12:.2f} TB moved, {floor.flops / 1e15:.2f} PFLOP)")
    print(f"  total tokens/s    {result['total_tokens_per_s']:10.1f}")
    print(f"  achieved / floor  {result['floor_ratio']:10.1%}   preemptions {result['num_preemptions']}, "
          f"KV pool {result['kv_capacity_tokens']:,} tokens ({result['kv_cache_dtype']})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
