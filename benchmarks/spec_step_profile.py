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
        profile = cProfile.Profile()
        begin = time.perf_counter()
        profile.enable()
        for _ in range(steps):
            engine.step()
        profile.disable()
        results[k] = (time.perf_counter() - begin) * 1e3 / steps, _met_functions(profile, steps)
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
