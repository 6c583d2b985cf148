"""Where a verify step's host time goes: engine steps of one request with k forced drafts against
plain steps (k = 0), under cProfile, met's own functions (model code left out) by the time each
adds per step, largest first. The GPU work is the same with or without the profiler's overhead;
what it shows is the host's share of `met benchmark spec-cost-table`'s verify / plain ratio.

    PYTHONPATH=. python3 benchmarks/spec_step_profile.py --model metrale/model_configs/Qwen3-8B --ks 1,4
"""

import argparse
import cProfile
import pstats
import random
import time

from metrale.bench.spec_cost_table import ForcedDrafter
from metrale.entrypoints.llm import LLM
from metrale.messages.sampling_params import SamplingParams


def profile_steps(engine, steps: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """(wall ms per step, {function: (cumulative us per step, calls per step)}) over `steps` steps."""
    profiler = cProfile.Profile()
    begin = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    wall_ms = (time.perf_counter() - begin) * 1e3 / steps
    stats = pstats.Stats(profiler).stats
    return wall_ms, {f"{path.split('metrale/')[-1]}:{name}": (v[3] / steps * 1e6, v[0] / steps)
                     for (path, _, name), v in stats.items()
                     if "metrale/" in path and "/models/" not in path and "/layers/" not in path}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="metrale/model_configs/Qwen3-8B")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--ks", default="1,4", help="draft counts to compare with k = 0")
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    llm = LLM(args.model, load_format=args.load_format, skip_tokenizer_init=True, max_num_seqs=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": max(ks)})
    engine, scheduler = llm.llm_engine, llm.llm_engine.scheduler
    rng = random.Random(0)
    prompt = [rng.randrange(engine.model_config.vocab_size) for _ in range(args.context_len)]
    engine.add_request("profiled", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=(len(ks) + 1) * (args.steps + 5) * (max(ks) + 1),
                                      ignore_eos=True))
    results = {}
    for k in [0] + ks:
        scheduler.drafter = ForcedDrafter(k, 0)
        for _ in range(5):  # the prefill, then warm steps of this k
            engine.step()
        results[k] = profile_steps(engine, args.steps)
    plain_ms, plain = results[0]
    for k in ks:
        wall_ms, verify = results[k]
        print(f"k={k}: {wall_ms:.3f} ms per step under the profiler, plain {plain_ms:.3f} ms "
              f"({wall_ms / plain_ms:.3f}x); met's functions, us per step (cumulative):")
        names = sorted(set(plain) | set(verify), key=lambda n: plain.get(n, (0, 0))[0] - verify.get(n, (0, 0))[0])
        for name in names[:args.top]:
            a, b = plain.get(name, (0.0, 0.0)), verify.get(name, (0.0, 0.0))
            print(f"  {a[0]:9.1f} {b[0]:9.1f} {b[0] - a[0]:+9.1f}  calls {a[1]:.1f}/{b[1]:.1f}  {name}")


if __name__ == "__main__":
    main()
