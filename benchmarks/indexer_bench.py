"""DSA indexer microbenchmark: the Triton scores and top-k kernels (kernels/dsa_indexer.py) at
DeepSeek-V3.2's indexer shape (64 heads, head_dim 128, index_topk 2048), bf16 and fp8 keys.

Cases: decode at batch 1 and 64 over 4k and 16k contexts, one 4,096-token prefill chunk. For each,
microseconds per call of the scores kernel and of the top-k (the Triton radix select, and
torch.topk over the same scores for comparison), the bytes a call must move at least (every
visible key once, its scale for fp8, q, w and the scores written; top-k: the scores read once and
the selection written), that over the device-to-device copy bandwidth measured at start as the
HBM floor, and the floor as a share of the time. Prefill also reports TFLOP/s of the scores' dots
(causal). Every time is the median over replays of a CUDA graph holding --calls calls (at least
one per copy); decode cases cycle through enough copies of their keys that no call finds them in
L2.

Agreement: the share of the bf16 keys' selections that the fp8 keys (the same keys quantized)
keep, on random data (q, keys normal; w normal times the folded scales), per case, over the rows
that see more than index_topk positions.

    PYTHONPATH=. python3 benchmarks/indexer_bench.py [--cases b1_4k,b64_16k,prefill_4k] [--sweep]
    PYTHONPATH=. TRITON_INTERPRET=1 python3 benchmarks/indexer_bench.py --cpu-smoke [--sweep]

--cpu-smoke runs every step of the benchmark at tiny shapes on the CPU under the interpreter,
with a wall-clock timer and a stand-in bandwidth (its numbers mean nothing): the GPU run's first
attempt then does not die on a typo.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from benchmarks.gemv_bench import copy_bandwidth, time_graph  # noqa: E402
from metrale.kernels import dsa_indexer, interpret_mode  # noqa: E402

FP8 = torch.float8_e4m3fn
BLOCK_SIZE = 16  # met's default
# (BLOCK_N, num_warps, num_stages) tried after the default with --sweep
SCORES_GRID = [(64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3), (32, 4, 2)]


@dataclass
class Setup:
    heads: int = 64
    head_dim: int = 128
    index_topk: int = 2048
    device: str = "cuda"
    # name -> (rows per sequence, sequences, context per sequence)
    cases: dict = field(default_factory=lambda: {
        "b1_4k": (1, 1, 4096),
        "b1_16k": (1, 1, 16384),
        "b64_4k": (1, 64, 4096),
        "b64_16k": (1, 64, 16384),
        "prefill_4k": (4096, 1, 4096),
    })
    max_copies: int = 256
    scores_grid: list = field(default_factory=lambda: list(SCORES_GRID))
    timer: Callable = time_graph  # (fn(i), calls, replays) -> us per call
    bandwidth: float = 0.0  # bytes/s of a device-to-device copy
    l2_bytes: int = 50 << 20


def wall_clock_timer(fn, calls, replays):
    """The smoke run's timer: every call once, us per call of wall-clock time."""
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) * 1e6 / max(calls, 1)


def smoke_setup() -> Setup:
    return Setup(heads=16, head_dim=32, index_topk=32, device="cpu",
                 cases={"b1": (1, 1, 100), "b3": (1, 3, 64), "prefill": (48, 1, 48)},
                 max_copies=3, scores_grid=[(32, 4, 2)], timer=wall_clock_timer, bandwidth=1e12, l2_bytes=1 << 12)


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def make_step(setup, rows_per_seq, num_seqs, context, copies, gen):
    """copies independent batches (their own shuffled blocks) of one step's layout, keys written
    both as bf16 and fp8 from the same values; q, w random."""
    device, d = setup.device, setup.head_dim
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = copies * num_seqs * blocks_per_seq
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(copies, num_seqs, blocks_per_seq)
    tables = [order[c].to(device) for c in range(copies)]
    bf16_cache = torch.empty(num_blocks, BLOCK_SIZE, d, dtype=torch.bfloat16, device=device)
    fp8_cache = torch.empty(num_blocks, BLOCK_SIZE, d, dtype=FP8, device=device)
    scale_cache = torch.empty(num_blocks, BLOCK_SIZE, 1, dtype=torch.float32, device=device)
    chunk = 1 << 20  # tokens written per call
    total = num_blocks * BLOCK_SIZE
    for at in range(0, total, chunk):
        n = min(chunk, total - at)
        keys = torch.randn(n, d, device=device, dtype=torch.bfloat16)
        slots = torch.arange(at, at + n, device=device)
        dsa_indexer.write_indexer_keys_triton(keys, bf16_cache, None, slots)
        dsa_indexer.write_indexer_keys_triton(keys, fp8_cache, scale_cache, slots)
    rows = rows_per_seq * num_seqs
    q = torch.randn(rows, setup.heads, d, device=device, dtype=torch.bfloat16)
    w = torch.randn(rows, setup.heads, device=device) * (setup.heads ** -0.5 * d ** -0.5)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * rows_per_seq
    return dict(q=q, w=w, tables=tables, caches={"bf16": (bf16_cache, None), "fp8": (fp8_cache, scale_cache)},
                seq_lens=seq_lens, query_start_loc=cu)


def agreement(bf16_sel, fp8_sel, row_pos, context, index_topk):
    """Share of bf16's selected positions that fp8 selects too, over the rows that see more than
    index_topk positions (the others select all they see, whatever the keys' precision)."""
    sparse = row_pos + 1 > index_topk
    bf16_sel, fp8_sel = bf16_sel[sparse], fp8_sel[sparse]
    chosen = torch.zeros(bf16_sel.shape[0], context + 1, dtype=torch.bool, device=bf16_sel.device)
    chosen.scatter_(1, torch.where(bf16_sel < 0, context, bf16_sel).long(), True)
    kept = chosen.gather(1, torch.where(fp8_sel < 0, context, fp8_sel).long()) & (fp8_sel >= 0)
    return kept.sum().item() / max(1, (bf16_sel >= 0).sum().item())


def run_case(setup, name, args, gen):
    rows_per_seq, num_seqs, context = setup.cases[name]
    heads, d, index_topk, timer = setup.heads, setup.head_dim, setup.index_topk, setup.timer
    rows = rows_per_seq * num_seqs
    key_bytes = {"bf16": d * 2, "fp8": d + 4}
    visible_keys = num_seqs * context  # every distinct key is read at least once
    # Decode: distinct copies of the keys, > 4x L2 in flight, one per call; prefill reads its keys
    # from L2 after the first row anyway.
    copies = 1 if rows_per_seq > 1 else max(1, min(setup.max_copies,
                                                   math.ceil(4 * setup.l2_bytes / (visible_keys * key_bytes["bf16"]))))
    calls = max(args.calls, copies)
    step = make_step(setup, rows_per_seq, num_seqs, context, copies, gen)
    rows_pair = dsa_indexer.row_positions(step["seq_lens"], step["query_start_loc"], rows)
    out, selections = [], {}
    for kind in ("bf16", "fp8"):
        key_cache, scale_cache = step["caches"][kind]

        def scores_fn(config):
            return lambda i: dsa_indexer.indexer_scores_triton(
                step["q"], step["w"], key_cache, scale_cache, step["tables"][i % copies], step["seq_lens"],
                step["query_start_loc"], context, rows=rows_pair, config=config)

        timings = {}
        for config in [None] + (setup.scores_grid if args.sweep else []):
            try:
                timings[config] = timer(scores_fn(config), calls, args.replays)
            except Exception as e:  # a config that does not compile on this device
                if config is None:
                    raise
                _log(f"{name} {kind} {config}: {type(e).__name__}: {str(e)[:200]}")
        scores_us = timings[None]
        best = min(timings, key=timings.get)
        scores = scores_fn(None)(0)
        topk_us = timer(lambda i: dsa_indexer.select_topk_triton(scores, rows_pair[1], index_topk), calls,
                        args.replays)
        torch_topk_us = timer(lambda i: scores.topk(index_topk, dim=1, sorted=False), calls, args.replays)
        selections[kind] = dsa_indexer.select_topk_triton(scores, rows_pair[1], index_topk)
        scores_bytes = visible_keys * key_bytes[kind] + rows * heads * (d * 2 + 4) + rows * context * 4
        topk_bytes = rows * context * 4 + rows * index_topk * 4
        causal_pairs = rows * context if rows_per_seq == 1 else rows_per_seq * (rows_per_seq + 1) // 2
        out.append(dict(case=name, keys=kind, scores_us=scores_us, scores_mb=scores_bytes / 1e6,
                        scores_floor=scores_bytes / setup.bandwidth * 1e6 / scores_us,
                        tflops=2 * causal_pairs * heads * d / scores_us / 1e6, topk_us=topk_us,
                        topk_floor=topk_bytes / setup.bandwidth * 1e6 / topk_us, torch_topk_us=torch_topk_us,
                        best=(best, timings[best]) if args.sweep else None))
    agree = agreement(selections["bf16"], selections["fp8"], rows_pair[1], context, index_topk)
    for row in out:
        row["agreement"] = agree
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time the scores kernel at SCORES_GRID's configs")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU interpreter (needs TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        if not interpret_mode():
            _log("--cpu-smoke needs TRITON_INTERPRET=1 (set before Python starts)")
            return 2
        setup = smoke_setup()
    elif not torch.cuda.is_available():
        _log("indexer_bench times CUDA kernels: no CUDA device here (--cpu-smoke checks the rest)")
        return 2
    else:
        setup = Setup(bandwidth=copy_bandwidth(),
                      l2_bytes=getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
        _log(f"{torch.cuda.get_device_name(0)}: copy bandwidth {setup.bandwidth / 1e9:.0f} GB/s, "
             f"L2 {setup.l2_bytes >> 20} MiB")
    gen = torch.Generator().manual_seed(0)
    print(f"heads {setup.heads}, head_dim {setup.head_dim}, index_topk {setup.index_topk}, block_size {BLOCK_SIZE}")
    print("| case | keys | scores us | MB | % of floor | TFLOP/s | top-k us | % of floor | torch.topk us "
          "| fp8 keeps |" + (" best scores config |" if args.sweep else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.sweep else ""))
    for name in (args.cases.split(",") if args.cases else setup.cases):
        for r in run_case(setup, name, args, gen):
            best = f" {r['best'][0]} {r['best'][1]:.1f} us |" if r["best"] else ""
            print(f"| {r['case']} | {r['keys']} | {r['scores_us']:.1f} | {r['scores_mb']:.2f} "
                  f"| {100 * r['scores_floor']:.0f}% | {r['tflops']:.1f} | {r['topk_us']:.1f} "
                  f"| {100 * r['topk_floor']:.0f}% | {r['torch_topk_us']:.1f} | {100 * r['agreement']:.2f}% |{best}",
                  flush=True)
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
