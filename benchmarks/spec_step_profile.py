"""Where a batch-1 speculative step's time goes: one request of `met bench latency`'s workload
(random prompt, greedy, ignore_eos), plain and with drafts, each engine.step() timed (steps that
gave one token and steps that gave more, apart), then the speculative run again under a profiler
(torch.profiler's host ops and kernels on CUDA, cProfile's Python functions on the CPU).

    PYTHONPATH=. python3 benchmarks/spec_step_profile.py --model demo
    PYTHONPATH=. python3 benchmarks/spec_step_profile.py --model metrale/model_configs/Qwen3-8B --load-format dummy
    PYTHONPATH=. python3 benchmarks/spec_step_profile.py --model metrale/model_configs/Qwen3-8B --load-format dummy \
        --hf-overrides '{"num_nextn_predict_layers": 1}' --speculative-config '{"method": "mtp"}' --speculative-only

Prints per run: steps, ms per step, ms per generated token (plain synchronous, plain with the
engine's default scheduling, speculative), then the profile's top functions.

`--forced-ks 1,4` instead: steps of exactly k drafts (the spec-cost table's forced drafter)
against plain steps (k = 0) of one request, under cProfile, met's own functions (model code left
out) by the host time each adds per step, largest first: the host's share of
`met benchmark spec-cost-table`'s verify / plain ratio.

`--forced-ks 1,4 --device-timeline` (CUDA): the same steps under torch.profiler's kernel trace
instead, per step: the GPU's busy time and its idle gaps, kernels launched inside CUDA graphs and
outside them (count and time), and the kernels whose time differs most from a plain step's: the
device's share of that ratio.
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metrale import LLM  # noqa: E402
from metrale.messages.sampling_params import SamplingParams  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def one_request(engine, prompt, output_len, tag):
    """[(seconds, tokens the request gained)] per engine.step() call."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request(tag, {"prompt_token_ids": prompt}, params)
    request = engine.scheduler.requests[tag]
    steps, before = [], 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        now = request.num_output_tokens
        steps.append((time.perf_counter() - start, now - before))
        before = now
    return steps


def profiled(engine, prompt, output_len, rows):
    if torch.cuda.is_available():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            one_request(engine, prompt, output_len, "profiled")
            torch.cuda.synchronize()
        table = prof.key_averages()
        return (table.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
                + table.table(sort_by="cuda_time_total", row_limit=rows // 2, max_name_column_width=60))
    profile = cProfile.Profile()
    profile.enable()
    one_request(engine, prompt, output_len, "profiled")
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def run(args, label, **engine_kwargs):
    llm = LLM(args.model, load_format=args.load_format, skip_tokenizer_init=True, max_model_len=2048,
              max_num_seqs=8, **engine_kwargs)
    engine = llm.llm_engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(3)]
    for i in range(2):
        one_request(engine, prompts[i], args.output_len, f"warmup{i}")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps = one_request(engine, prompts[2], args.output_len, "measured")
    decode = steps[1:]  # the first step is the prefill
    total = sum(t for t, _ in decode)
    print(f"{label:>24}: scheduling {'async' if engine.async_scheduling else 'sync'}, {len(steps)} steps, "
          f"decode {total / len(decode) * 1e3:.3f} ms/step, {total / (args.output_len - 1) * 1e3:.3f} ms/token")
    for name, group in (("one token", [t for t, n in decode if n == 1]), ("several", [t for t, n in decode if n > 1]),
                        ("none", [t for t, n in decode if n == 0])):
        if group:
            print(f"{'':>26}{name:>10}: {len(group):4d} steps, median {statistics.median(group) * 1e3:.3f} ms")
    if engine_kwargs.get("speculative_config"):
        print(profiled(engine, prompts[0], args.output_len, args.rows))
    del llm, engine


def _met_functions(profile, steps: int) -> dict[str, tuple[float, float]]:
    """{function: (cumulative us per step, calls per step)} of met's non-model code."""
    return {f"{path.split('metrale/')[-1]}:{name}": (v[3] / steps * 1e6, v[0] / steps)
            for (path, _, name), v in pstats.Stats(profile).stats.items()
            if "metrale/" in path and "/models/" not in path and "/layers/" not in path}


def _kernel_summary(trace: dict, steps: int) -> dict:
    """A chrome trace's GPU work per step: busy and idle microseconds (idle: gaps between the
    first kernel's start and the last one's end), kernels launched by a graph or one by one, and
    {kernel name: us}."""
    graph_launches = {e["args"].get("correlation") for e in trace["traceEvents"]
                      if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch"}
    kernels = sorted((e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    busy, end, by_name = 0.0, None, {}
    counts = {"graph": [0, 0.0], "eager": [0, 0.0]}
    for e in kernels:
        start, stop = e["ts"], e["ts"] + e["dur"]
        busy += max(0.0, stop - max(start, end)) if end is not None else e["dur"]
        end = stop if end is None else max(end, stop)
        kind = "graph" if e["args"].get("correlation") in graph_launches else "eager"
        counts[kind][0] += 1
        counts[kind][1] += e["dur"]
        by_name[e["name"][:80]] = by_name.get(e["name"][:80], 0.0) + e["dur"]
    span = (end - kernels[0]["ts"]) if kernels else 0.0
    return {"busy": busy / steps, "idle": (span - busy) / steps,
            **{f"{kind}_{what}": v[i] / steps for kind, v in counts.items() for i, what in enumerate(("n", "us"))},
            "by_name": {name: us / steps for name, us in by_name.items()},
            "by_site": _launch_sites(trace, kernels, graph_launches, steps)}


def _launch_sites(trace: dict, kernels: list, graph_launches: set, steps: int) -> dict[str, list[float]]:
    """{met's innermost Python function that launched a kernel (or replayed its graph):
    [eager kernels, their us, the GPU's idle us just before them]} per step, from the trace's
    Python events (the profiler's with_stack)."""
    import bisect

    frames = {}  # tid -> sorted [(start, end, name)] of met's Python functions
    for e in trace["traceEvents"]:
        if e.get("cat") == "python_function" and "metrale/" in e.get("name", ""):
            frames.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    for fs in frames.values():
        fs.sort()
    starts = {tid: [f[0] for f in fs] for tid, fs in frames.items()}
    launches = {e["args"].get("correlation"): e for e in trace["traceEvents"] if e.get("cat") == "cuda_runtime"}

    def site(launch) -> str:
        fs, ts = frames.get(launch["tid"], []), launch["ts"]
        i = bisect.bisect_right(starts.get(launch["tid"], []), ts) - 1
        while i >= 0 and fs[i][1] < ts:  # a sibling that ended before: walk back to an enclosing frame
            i -= 1
        return fs[i][2].split("metrale/")[-1] if i >= 0 else "(outside met)"

    out, end = {}, None
    for e in kernels:
        launch = launches.get(e["args"].get("correlation"))
        name = site(launch) if launch is not None else "(no launch event)"
        graph = e["args"].get("correlation") in graph_launches
        row = out.setdefault(("graph " if graph else "") + name, [0.0, 0.0, 0.0])
        if not graph:
            row[0] += 1 / steps
            row[1] += e["dur"] / steps
        if end is not None and e["ts"] > end:
            row[2] += (e["ts"] - end) / steps
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
    return out


def _device_timeline(engine, steps: int) -> dict:
    import tempfile

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return _kernel_summary(json.load(open(f.name)), steps)


def _print_device_diff(k: int, plain: dict, verify: dict, rows: int) -> None:
    print(f"k={k}: per step, plain / verify (us): busy {plain['busy']:.1f} / {verify['busy']:.1f} "
          f"({verify['busy'] - plain['busy']:+.1f}), idle {plain['idle']:.1f} / {verify['idle']:.1f} "
          f"({verify['idle'] - plain['idle']:+.1f}); graph kernels {plain['graph_n']:.0f} / {verify['graph_n']:.0f} "
          f"({plain['graph_us']:.1f} / {verify['graph_us']:.1f} us), eager kernels {plain['eager_n']:.0f} / "
          f"{verify['eager_n']:.0f} ({plain['eager_us']:.1f} / {verify['eager_us']:.1f} us)")
    a, b = plain["by_name"], verify["by_name"]
    for name in sorted(set(a) | set(b), key=lambda n: abs(b.get(n, 0.0) - a.get(n, 0.0)), reverse=True)[:rows]:
        print(f"  {a.get(name, 0.0):9.1f} {b.get(name, 0.0):9.1f} {b.get(name, 0.0) - a.get(name, 0.0):+9.1f}  {name}")
    print("  by launch site, plain / verify per step: eager kernels, their us, the idle us before them")
    a, b = plain["by_site"], verify["by_site"]
    zero = [0.0, 0.0, 0.0]
    for name in sorted(set(a) | set(b), key=lambda n: sum(b.get(n, zero)[1:]) - sum(a.get(n, zero)[1:]),
                       reverse=True)[:rows]:
        x, y = a.get(name, zero), b.get(name, zero)
        print(f"  {x[0]:5.1f} / {y[0]:5.1f} kernels  {x[1]:7.1f} / {y[1]:7.1f} us  idle {x[2]:7.1f} / {y[2]:7.1f} us  "
              f"{name}")


def forced_draft_diff(args, ks: list[int], steps: int = 40, **engine_kwargs):
    from metrale.bench.spec_cost_table import ForcedDrafter

    llm = LLM(args.model, load_format=args.load_format, skip_tokenizer_init=True, max_num_seqs=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": max(ks)}, **engine_kwargs)
    engine, scheduler = llm.llm_engine, llm.llm_engine.scheduler
    rng = random.Random(0)
    prompt = [rng.randrange(engine.model_config.vocab_size) for _ in range(args.input_len)]
    params = SamplingParams(temperature=0, max_tokens=(len(ks) + 1) * (steps + 5) * (max(ks) + 1), ignore_eos=True)
    engine.add_request("profiled", {"prompt_token_ids": prompt}, params)
    results = {}
    for k in [0] + ks:
        scheduler.drafter = ForcedDrafter(k, 0)
        for _ in range(5):  # the prefill, then warm steps of this k
            engine.step()
        if args.device_timeline:
            results[k] = _device_timeline(engine, steps)
            continue
        profile = cProfile.Profile()
        begin = time.perf_counter()
        profile.enable()
        for _ in range(steps):
            engine.step()
        profile.disable()
        results[k] = (time.perf_counter() - begin) * 1e3 / steps, _met_functions(profile, steps)
    if args.device_timeline:
        for k in ks:
            _print_device_diff(k, results[0], results[k], args.rows)
        return
    plain_ms, plain = results[0]
    for k in ks:
        wall_ms, verify = results[k]
        print(f"k={k}: {wall_ms:.3f} ms per step under the profiler, plain {plain_ms:.3f} ms "
              f"({wall_ms / plain_ms:.3f}x); met's functions, us per step (cumulative):")
        names = sorted(set(plain) | set(verify), key=lambda n: plain.get(n, (0, 0))[0] - verify.get(n, (0, 0))[0])
        for name in names[:args.rows]:
            a, b = plain.get(name, (0.0, 0.0)), verify.get(name, (0.0, 0.0))
            print(f"  {a[0]:9.1f} {b[0]:9.1f} {b[0] - a[0]:+9.1f}  calls {a[1]:.1f}/{b[1]:.1f}  {name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM))
    parser.add_argument("--rows", type=int, default=30, help="profile rows")
    parser.add_argument("--hf-overrides", default=None, help="JSON object of config.json fields to replace")
    parser.add_argument("--speculative-only", action="store_true", help="skip the two plain runs")
    parser.add_argument("--forced-ks", default=None,
                        help="comma-separated draft counts: host time by function against k = 0 instead")
    parser.add_argument("--device-timeline", action="store_true",
                        help="with --forced-ks on CUDA: the kernel trace's time per step against k = 0")
    args = parser.parse_args()
    extra = {"hf_overrides": args.hf_overrides} if args.hf_overrides else {}
    if args.forced_ks:
        return forced_draft_diff(args, [int(k) for k in args.forced_ks.split(",")], **extra)
    if not args.speculative_only:
        run(args, "plain, synchronous", async_scheduling=False, **extra)
        run(args, "plain, default", **extra)
    run(args, "speculative", speculative_config=json.loads(args.speculative_config), **extra)


if __name__ == "__main__":
    main()
