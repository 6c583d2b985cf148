"""The Triton sampler's GPU time by batch size and filters, at Qwen3's vocabulary (151,936):

    PYTHONPATH=. python3 benchmarks/sampler_bench.py

Prints a markdown table of microseconds per call (median of CUDA-event timings) for greedy,
temperature, temperature + min-p, + top-k, + top-p and + both, at 1, 8, 64 and 256 rows, each
through what the engine would launch (the vocab-parallel path where it applies).
"""

import argparse
import statistics
import sys

import torch

CONFIGS = {  # (temperature, top_k, top_p, min_p)
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature 0.6": (0.6, 0, 1.0, 0.0),
    "+ min-p 0.05": (0.6, 0, 1.0, 0.05),
    "+ top-k 20": (0.6, 20, 1.0, 0.0),
    "+ top-p 0.95": (0.6, 0, 0.95, 0.0),
    "+ top-k 20, top-p 0.8": (0.6, 20, 0.8, 0.0),
}


def time_us(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sampler_bench.py needs a CUDA GPU", file=sys.stderr)
        return 1
    from metrale.kernels.sampling import sample_tokens_triton

    print("| filters | " + " | ".join(f"{n} rows (us)" for n in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name, (temp, top_k, top_p, min_p) in CONFIGS.items():
        cells = []
        for n in args.rows:
            logits = torch.randn(n, args.vocab, device="cuda") * 3
            column = lambda v, dtype: torch.full((n,), v, dtype=dtype, device="cuda")  # noqa: E731
            params = dict(temperature=column(temp, torch.float32), top_k=column(top_k, torch.int64),
                          top_p=column(top_p, torch.float32), min_p=column(min_p, torch.float32),
                          seeds=torch.arange(n, device="cuda"), offsets=torch.zeros(n, dtype=torch.int64, device="cuda"))
            flags = dict(any_top_k=temp > 0 and top_k > 0, any_top_p=temp > 0 and top_p < 1.0,
                         any_min_p=temp > 0 and min_p > 0)
            if temp == 0:  # the engine samples all-greedy batches with an argmax
                cells.append(time_us(lambda: logits.argmax(dim=-1), args.iters))
                continue
            sample_tokens_triton(logits, **params, **flags)  # compile
            cells.append(time_us(lambda: sample_tokens_triton(logits, **params, **flags), args.iters))
        print(f"| {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
