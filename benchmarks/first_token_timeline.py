"""Where the time to first token goes, per iteration, without a profiler in the way.

`met bench latency`'s workload (one request of random prompt tokens, greedy, ignore_eos), each
iteration run up to its first token. The engine's host phases are timed by wrapping them
(scheduler.schedule, runner.prepare_inputs, the forward's launch, the rest of the runner's
launch, PendingOutput.result's wait, the update); the device span of the step that gives the
first token is timed with CUDA events recorded before its launch and after its last kernel
(so `gpu` is the device's time from the launch's start to its end: when it is about the host's
launch time, the step is bound by launching). Python's garbage collections inside the window
are timed through gc.callbacks.

    PYTHONPATH=. python3 benchmarks/first_token_timeline.py --model Qwen3-8B --input-len 512
    PYTHONPATH=. python3 benchmarks/first_token_timeline.py --model Qwen3-8B --no-async-scheduling
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metrale import LLM, SamplingParams  # noqa: E402


class Phases:
    """Host seconds per named phase since the last reset, and the garbage collector's pauses."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.gc_seconds = 0.0
        self.gc_count = 0
        self._gc_start = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_seconds += time.perf_counter() - self._gc_start
            self.gc_count += 1
            self._gc_start = None

    def reset(self) -> None:
        self.seconds.clear()
        self.gc_seconds, self.gc_count = 0.0, 0

    def wrap(self, owner, name: str, label: str | None = None) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label or name] += time.perf_counter() - start

        setattr(owner, name, timed)


def instrument(engine, phases: Phases, device_spans: list) -> None:
    runner = engine.runner
    phases.wrap(engine.scheduler, "schedule")
    phases.wrap(engine.scheduler, "update")
    phases.wrap(runner, "prepare_inputs")
    phases.wrap(runner, "forward", "forward launch (eager)")
    phases.wrap(runner, "replay_graph", "graph replay launch")
    cuda = engine.device.type == "cuda"
    launch = runner.execute_async

    def execute(plan):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        pending = launch(plan)
        phases.seconds["runner launch (all)"] += time.perf_counter() - t
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            device_spans.append((start, end, plan.total_num_scheduled_tokens))
        result = pending.result

        def timed_result():
            t0 = time.perf_counter()
            try:
                return result()
            finally:
                phases.seconds["result wait"] += time.perf_counter() - t0

        pending.result = timed_result
        return pending

    runner.execute_async = execute


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen3-8B")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-iters", type=int, default=20)
    parser.add_argument("--num-iters-warmup", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16,
                        help="decode steps after the first token in each iteration (the GPU stays as busy as in bench latency)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=None,
                        help="gc.freeze() after startup (default: the engine's own choice)")
    parser.add_argument("--host-profile", type=int, default=0,
                        help="then one more iteration under cProfile: its N functions of most own time")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    llm = LLM(args.model, load_format=args.load_format, skip_tokenizer_init=True, max_model_len=args.max_model_len,
              max_num_seqs=8, async_scheduling=args.async_scheduling)
    engine = llm.llm_engine
    if args.gc_freeze is True:
        gc.collect()
        gc.freeze()
    elif args.gc_freeze is False:
        gc.unfreeze()
    phases, spans = Phases(), []
    instrument(engine, phases, spans)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1 + args.decode_steps, ignore_eos=True)
    print(f"{args.model}: {args.input_len} prompt tokens, scheduling "
          f"{'asynchronous' if engine.async_scheduling else 'synchronous'}, gc frozen objects {gc.get_freeze_count()}")
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    rows = []
    for i in range(args.num_iters_warmup + args.num_iters):
        prompt = [rng.randrange(vocab) for _ in range(args.input_len)]
        sync()
        phases.reset()
        spans.clear()
        start = time.perf_counter()
        engine.add_request(f"it{i}", {"prompt_token_ids": prompt}, params)
        steps = 0
        while True:
            steps += 1
            if engine.step():
                break
        ttft = time.perf_counter() - start
        window = dict(phases.seconds)
        gc_s, gc_n = phases.gc_seconds, phases.gc_count
        sync()
        gpu = [(s.elapsed_time(e) / 1e3, n) for s, e, n in spans]
        while engine.has_unfinished_requests():
            engine.step()
        if i < args.num_iters_warmup:
            continue
        rows.append(dict(ttft_s=ttft, steps=steps, host=window, gc_s=gc_s, gc_count=gc_n, device_spans=gpu))
        phase_text = "  ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(window.items()))
        span_text = ", ".join(f"{s * 1e3:.2f} ms ({n} tok)" for s, n in gpu)
        print(f"iter {i - args.num_iters_warmup:2d}: ttft {ttft * 1e3:7.2f} ms  steps {steps}  "
              f"gc {gc_s * 1e3:.2f} ms ({gc_n})  device {span_text}  |  {phase_text}")
    ttfts = [r["ttft_s"] for r in rows]
    print(f"ttft median {statistics.median(ttfts) * 1e3:.2f} ms  min {min(ttfts) * 1e3:.2f}  max {max(ttfts) * 1e3:.2f}")
    for name in sorted({k for r in rows for k in r["host"]}):
        values = [r["host"].get(name, 0.0) for r in rows]
        print(f"  {name:<26} median {statistics.median(values) * 1e3:7.2f} ms  max {max(values) * 1e3:7.2f}")
    print(f"  {'gc pauses':<26} median {statistics.median(r['gc_s'] for r in rows) * 1e3:7.2f} ms  "
          f"max {max(r['gc_s'] for r in rows) * 1e3:7.2f}")
    prefill = [max(s for s, _ in r["device_spans"]) for r in rows if r["device_spans"]]
    if prefill:
        print(f"  {'device span, longest step':<26} median {statistics.median(prefill) * 1e3:7.2f} ms  "
              f"max {max(prefill) * 1e3:7.2f}")
    if args.host_profile:
        import cProfile
        import pstats

        prompt = [rng.randrange(vocab) for _ in range(args.input_len)]
        sync()
        profiler = cProfile.Profile()
        profiler.enable()
        engine.add_request("profiled", {"prompt_token_ids": prompt}, params)
        while not engine.step():
            pass
        profiler.disable()
        while engine.has_unfinished_requests():
            engine.step()
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(args.host_profile)
        stats.sort_stats("cumulative").print_stats(args.host_profile)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "input_len": args.input_len, "async": engine.async_scheduling,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
