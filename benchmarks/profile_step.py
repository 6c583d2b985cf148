"""Where a step's time goes on the GPU: torch.profiler over steady-state steps of the
throughput workload, kernels by CUDA time and host functions by CPU time.

    python benchmarks/profile_step.py --model Qwen3-0.6B --num-prompts 256
    python benchmarks/profile_step.py --model Qwen3-8B --num-prompts 1 --max-num-seqs 1   # batch-1 decode
    python benchmarks/profile_step.py --model Qwen3-8B --num-prompts 1 --max-num-seqs 1 --tp-size 2
    python benchmarks/profile_step.py --model Qwen3-8B --first-token 512 [--no-async-scheduling]

With --tp-size/--ep-size the profile is rank 0's: its collectives' kernels include the time spent
waiting for the other ranks.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metrale import LLM  # noqa: E402
from metrale.bench.workload import random_workload  # noqa: E402


def profile_prefill(args):
    n = args.prefill_prompts
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len,
              max_num_seqs=max(8, n), hf_overrides=args.hf_overrides,
              max_num_batched_tokens=max(8192, n * args.prefill_len))
    from metrale import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)

    def prompts(salt):
        return [{"prompt_token_ids": [(p * 31 + j * salt) % 1000 for j in range(args.prefill_len)]} for p in range(n)]

    for i in range(3):
        llm.generate(prompts(i + 7), params)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts(13), params)
    torch.cuda.synchronize()
    print(f"prefill of {n} x {args.prefill_len} tokens: {(time.perf_counter() - start) * 1e3:.2f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts(17), params)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.table_rows, max_name_column_width=60))


def profile_first_token(args):
    """Where the time to first token goes: each engine.step() call from add_request to the first
    output and three decode steps after it, timed, and the host functions of that window."""
    from metrale import SamplingParams

    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len,
              max_num_seqs=8, async_scheduling=args.async_scheduling, hf_overrides=args.hf_overrides)
    engine = llm.llm_engine
    print(f"asynchronous scheduling: {engine.async_scheduling}")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    vocab = min(1000, engine.model_config.vocab_size)

    def one(tag: str, prompt: list[int]) -> list[tuple[float, int]]:
        calls = []
        start = time.perf_counter()
        engine.add_request(tag, {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            out = engine.step()
            calls.append((time.perf_counter() - start, len(out)))
        return calls

    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(2):
        one(f"warmup{i}", [(i * 7 + j) % vocab for j in range(args.first_token)])
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        calls = one("measured", [(j * 13) % vocab for j in range(args.first_token)])
        sync()
    first = next(i for i, (_, n) in enumerate(calls) if n)
    for i, (t, n) in enumerate(calls[:first + 4]):
        print(f"step call {i}: returned at {t * 1e3:8.2f} ms with {n} output(s)"
              + ("   <- first token" if i == first else ""))
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    if cuda:
        print(table.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen3-0.6B")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--skip-steps", type=int, default=60)
    parser.add_argument("--active-steps", type=int, default=10)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096, help="for --first-token and --prefill-len")
    parser.add_argument("--hf-overrides", default="", help="JSON object of config.json fields to replace")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--table-rows", type=int, default=18, help="rows of the kernel table")
    parser.add_argument("--prefill-len", type=int, default=0, help="profile one prefill of this many tokens instead")
    parser.add_argument("--prefill-prompts", type=int, default=1, help="with --prefill-len: prompts in the one step")
    parser.add_argument("--first-token", type=int, default=0,
                        help="time each step of one request with a prompt of this many tokens up to its first tokens")
    parser.add_argument("--programmatic-launch", action=argparse.BooleanOptionalAction, default=None,
                        help="steady-state profile: launch with programmatic dependent launch (default: the engine's, "
                             "on where supported); off gives each kernel's own time, which PDL's early starts inflate")
    parser.add_argument("--kv-cache-dtype", default="auto", help="steady-state profile: auto (the model's) or fp8")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="for --first-token (default: the engine's, on with CUDA)")
    args = parser.parse_args()
    if args.prefill_len:
        return profile_prefill(args)
    if args.first_token:
        return profile_first_token(args)
    work = random_workload(args.num_prompts, (100, 1024), (100, 1024), 0)
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              max_num_seqs=args.max_num_seqs, tp_size=args.tp_size, ep_size=args.ep_size,
              hf_overrides=args.hf_overrides, programmatic_launch=args.programmatic_launch,
              kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(work.prompts, work.params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp.clone(output_kind="final_only"))
    for _ in range(args.skip_steps):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    n = 20
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    print(f"steady state: {(time.perf_counter() - start) / n * 1e3:.2f} ms/step, "
          f"{len(engine.scheduler.running)} running")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.active_steps):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    # GPU busy time per step: the sum of kernel (and copy) times; the rest of a step is GPU idle.
    busy_us = sum(e.self_device_time_total for e in table if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"GPU busy {busy_us / args.active_steps / 1e3:.2f} ms/step "
          f"({sum(e.count for e in table if e.device_type == torch.autograd.DeviceType.CUDA) // args.active_steps} "
          f"kernels and copies per step)")
    print(table.table(sort_by="cuda_time_total", row_limit=args.table_rows, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
