"""Host time of one staged upload: a fresh pinned buffer per copy (what a step did before
executor/host_staging.py) against HostStaging's reused ring, on one CUDA device.

    PYTHONPATH=. python3 benchmarks/host_staging_bench.py [--iters 20000] [--elements 64]

Each iteration takes a host buffer, writes it from numpy, and issues a non-blocking copy into a
static device buffer, as the runner does per purpose and step. Prints microseconds per iteration.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from metrale.executor.host_staging import HostStaging


def _fresh(dest: torch.Tensor, iters: int) -> float:
    start = time.perf_counter()
    for i in range(iters):
        host = torch.empty(dest.shape, dtype=dest.dtype, pin_memory=True)
        host.numpy()[:] = i
        dest.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def _ring(dest: torch.Tensor, iters: int) -> float:
    staging = HostStaging(dest.device)
    start = time.perf_counter()
    for i in range(iters):
        staged = staging.take("bench", dest.shape, dest.dtype)
        staged.host.numpy()[:] = i
        staged.copy_into(dest)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--elements", type=int, default=64)
    args = parser.parse_args()
    dest = torch.zeros(3, args.elements, dtype=torch.int64, device="cuda")
    for fn in (_fresh, _ring):  # warm-up: the caching host allocator's pool, the CUDA context
        fn(dest, 200)
    result = {"elements": 3 * args.elements, "iters": args.iters,
              "fresh_pinned_us": round(_fresh(dest, args.iters), 2), "reused_ring_us": round(_ring(dest, args.iters), 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
