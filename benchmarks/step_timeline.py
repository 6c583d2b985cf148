"""Where the nano-vllm workload's time goes, step by step, against each step's own floor.

    PYTHONPATH=. python3 benchmarks/step_timeline.py --model Qwen3-0.6B [--no-async-scheduling]

Runs the `met bench throughput` workload through engine.step() and records every step's plan
(prefill tokens, decoding sequences, their contexts) and wall time. A step's floor is its
weights plus its sequences' KV over the bandwidth measured at the start, or its FLOPs over the
matmul rate. The table groups steps into those with prefill chunks and pure decode steps by
batch size, so the gap to the floor shows where it is: fixed per-step costs (small batches),
KV reads (large batches) or prefill.

With asynchronous scheduling, step() call k returns once step k-1's tokens are read, so its
duration is charged to plan k-1.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metrale import LLM  # noqa: E402
from metrale.bench.hardware import measure  # noqa: E402
from metrale.bench.workload import random_workload, step_weight_bytes, weights_read_per_step  # noqa: E402

BUCKETS = ((1, 16), (17, 64), (65, 128), (129, 192), (193, 256), (257, 1 << 30))


def record_plans(engine) -> list:
    """Wrap the scheduler so that every plan it hands out is kept, with its contexts."""
    plans = []
    schedule = engine.scheduler.schedule

    def recording():
        plan, ended = schedule()
        requests = engine.scheduler.requests
        scheduled = plan.num_scheduled_tokens
        contexts = [requests[r].num_computed_tokens for r in scheduled if r in requests]
        plans.append({"tokens": plan.total_num_scheduled_tokens, "seqs": len(scheduled),
                      "prefill": any(n > 1 for n in scheduled.values()), "context": sum(contexts)})
        return plan, ended

    engine.scheduler.schedule = recording
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen3-0.6B")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--hf-overrides", default="", help="e.g. '{\"num_hidden_layers\": 2}' for a quick run")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    work = random_workload(args.num_prompts, (100, 1024), (100, 1024), 0)
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              max_num_seqs=args.max_num_seqs, async_scheduling=args.async_scheduling, hf_overrides=args.hf_overrides)
    engine = llm.llm_engine
    rates = measure(engine.device)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], work.params[0].clone(max_tokens=8), use_tqdm=False)
    weights = step_weight_bytes(engine.runner.model)
    _, active_params = weights_read_per_step(engine.runner.model, 1)
    kv_bytes = engine.memory_plan.kv_bytes_per_token
    plans = record_plans(engine)
    for i, (p, sp) in enumerate(zip(work.prompts, work.params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp.clone(output_kind="final_only"))
    durations = []
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    begin = last = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        durations.append(now - last)
        last = now
    total = last - begin
    lag = 1 if engine.async_scheduling else 0
    charged = [0.0] * len(plans)
    for k, seconds in enumerate(durations):
        charged[max(0, k - lag)] += seconds
    rows = {}
    for plan, seconds in zip(plans, charged):
        if plan["tokens"] == 0:
            continue
        floor = max((weights(plan["tokens"]) + kv_bytes * plan["context"]) / rates.bandwidth_bytes_per_s,
                    2 * active_params * plan["tokens"] / rates.matmul_flops_per_s)
        if plan["prefill"]:
            key = "steps with prefill chunks"
        else:
            lo, hi = next(b for b in BUCKETS if b[0] <= plan["seqs"] <= b[1])
            key = f"decode, {lo}-{hi} sequences"
        row = rows.setdefault(key, {"steps": 0, "seconds": 0.0, "floor": 0.0, "tokens": 0})
        row["steps"] += 1
        row["seconds"] += seconds
        row["floor"] += floor
        row["tokens"] += plan["tokens"]
    print(rates.describe())
    print(f"{len(plans)} steps in {total:.2f} s ({engine.scheduler.num_preemptions_total} preemptions); "
          f"async scheduling {engine.async_scheduling}")
    print("| steps | count | seconds | floor s | floor / time | ms per step | floor ms per step |")
    print("|---|---|---|---|---|---|---|")
    for key, row in rows.items():
        print(f"| {key} | {row['steps']} | {row['seconds']:.3f} | {row['floor']:.3f} | "
              f"{row['floor'] / row['seconds']:.1%} | {row['seconds'] / row['steps'] * 1e3:.2f} | "
              f"{row['floor'] / row['steps'] * 1e3:.2f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"total_s": total, "rows": rows, "plans": plans, "charged_s": charged}, f)


if __name__ == "__main__":
    main()
