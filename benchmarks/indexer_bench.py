"""DSA indexer microbenchmark: the Triton scores and top-k kernels (kernels/dsa_indexer.py) at
DeepSeek-V3.2's indexer shape (64 heads, head_dim 128, index_topk 2048), bf16 and fp8 keys.

Cases: decode at batch 1 and 64 over 4k and 16k contexts, one 4,096-token prefill chunk. For each,
microseconds per call of the scores kernel and of the top-k (the Triton radix select, and
torch.topk over the same scores for comparison), the bytes a call must move at least (every
visible key once, its scale for fp8, q, w and the scores written; top-k: the scores read once and
the selection written), that over the device-to-device copy bandwidth measured at start as the
HBM floor, and the floor as a share of the time. Prefill also reports TFLOP/s of the scores' dots
(causal). Every time is the median over replays of a CUDA graph holding --calls calls (at least one per copy); decode
cases cycle through enough copies of their keys that no call finds them in L2.

Agreement: the share of the bf16 keys' selections that the fp8 keys (the same keys quantized)
keep, on random data (q, keys normal; w normal times the folded scales), per case, over the rows
that see more than index_topk positions.

    PYTHONPATH=. python3 benchmarks/indexer_bench.py [--cases b1_4k,b64_16k,prefill_4k] [--sweep]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from benchmarks.gemv_bench import copy_bandwidth, time_graph  # noqa: E402
from metrale.kernels import dsa_indexer  # noqa: E402

HEADS, HEAD_DIM, INDEX_TOPK, BLOCK_SIZE = 64, 128, 2048, 16  # met's default block size
DEVICE = "cuda"
FP8 = torch.float8_e4m3fn
# name -> (rows per sequence, sequences, context per sequence)
CASES = {
    "b1_4k": (1, 1, 4096),
    "b1_16k": (1, 1, 16384),
    "b64_4k": (1, 64, 4096),
    "b64_16k": (1, 64, 16384),
    "prefill_4k": (4096, 1, 4096),
}
# (BLOCK_N, num_warps, num_stages) tried after the default with --sweep
MAX_COPIES = 256
SCORES_GRID = [(64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3), (32, 4, 2)]


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def make_step(rows_per_seq, num_seqs, context, copies, gen):
    """copies independent batches (their own shuffled blocks) of one step's layout, keys written
    both as bf16 and fp8 from the same values; q, w random."""
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = copies * num_seqs * blocks_per_seq
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(copies, num_seqs, blocks_per_seq)
    tables = [order[c].to(DEVICE) for c in range(copies)]
    bf16_cache = torch.empty(num_blocks, BLOCK_SIZE, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    fp8_cache = torch.empty(num_blocks, BLOCK_SIZE, HEAD_DIM, dtype=FP8, device=DEVICE)
    scale_cache = torch.empty(num_blocks, BLOCK_SIZE, 1, dtype=torch.float32, device=DEVICE)
    chunk = 1 << 20  # tokens written per call
    total = num_blocks * BLOCK_SIZE
    for at in range(0, total, chunk):
        n = min(chunk, total - at)
        keys = torch.randn(n, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        slots = torch.arange(at, at + n, device=DEVICE)
        dsa_indexer.write_indexer_keys(keys, bf16_cache, None, slots)
        dsa_indexer.write_indexer_keys(keys, fp8_cache, scale_cache, slots)
    rows = rows_per_seq * num_seqs
    q = torch.randn(rows, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(rows, HEADS, device=DEVICE) * (HEADS ** -0.5 * HEAD_DIM ** -0.5)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE) * rows_per_seq
    return dict(q=q, w=w, tables=tables, caches={"bf16": (bf16_cache, None), "fp8": (fp8_cache, scale_cache)},
                seq_lens=seq_lens, query_start_loc=cu)


def agreement(bf16_sel, fp8_sel, row_pos, context):
    """Share of bf16's selected positions that fp8 selects too, over the rows that see more than
    INDEX_TOPK positions (the others select all they see, whatever the keys' precision)."""
    sparse = row_pos + 1 > INDEX_TOPK
    bf16_sel, fp8_sel = bf16_sel[sparse], fp8_sel[sparse]
    chosen = torch.zeros(bf16_sel.shape[0], context + 1, dtype=torch.bool, device=bf16_sel.device)
    chosen.scatter_(1, torch.where(bf16_sel < 0, context, bf16_sel).long(), True)
    kept = chosen.gather(1, torch.where(fp8_sel < 0, context, fp8_sel).long()) & (fp8_sel >= 0)
    return kept.sum().item() / (bf16_sel >= 0).sum().item()


def run_case(name, args, bandwidth, l2_bytes, gen):
    rows_per_seq, num_seqs, context = CASES[name]
    rows = rows_per_seq * num_seqs
    key_bytes = {"bf16": HEAD_DIM * 2, "fp8": HEAD_DIM + 4}
    visible_keys = num_seqs * context  # every distinct key is read at least once
    set_bytes = visible_keys * key_bytes["bf16"]
    # Decode: distinct copies of the keys, > 4x L2 in flight, one per call; prefill reads its keys
    # from L2 after the first row anyway.
    copies = 1 if rows_per_seq > 1 else max(1, min(MAX_COPIES, math.ceil(4 * l2_bytes / set_bytes)))
    calls = max(args.calls, copies)
    step = make_step(rows_per_seq, num_seqs, context, copies, gen)
    rows_pair = dsa_indexer.row_positions(step["seq_lens"], step["query_start_loc"], rows)
    out, selections = [], {}
    for kind in ("bf16", "fp8"):
        key_cache, scale_cache = step["caches"][kind]

        def scores_fn(config):
            return lambda i: dsa_indexer.indexer_scores_triton(
                step["q"], step["w"], key_cache, scale_cache, step["tables"][i % copies], step["seq_lens"],
                step["query_start_loc"], context, rows=rows_pair, config=config)

        configs = [None] + (SCORES_GRID if args.sweep else [])
        timings = {}
        for config in configs:
            try:
                timings[config] = time_graph(scores_fn(config), calls, args.replays)
            except Exception as e:  # a config that does not compile on this device
                _log(f"{name} {kind} {config}: {type(e).__name__}: {str(e)[:200]}")
        scores_us = timings[None]
        best = min(timings, key=timings.get)
        scores = scores_fn(None)(0)
        topk_us = time_graph(lambda i: dsa_indexer.select_topk_triton(scores, rows_pair[1], INDEX_TOPK),
                             calls, args.replays)
        torch_topk_us = time_graph(lambda i: scores.topk(INDEX_TOPK, dim=1, sorted=False), calls, args.replays)
        selections[kind] = dsa_indexer.select_topk_triton(scores, rows_pair[1], INDEX_TOPK)
        scores_bytes = (visible_keys * key_bytes[kind] + rows * HEADS * (HEAD_DIM * 2 + 4) + rows * context * 4)
        topk_bytes = rows * context * 4 + rows * INDEX_TOPK * 4
        scores_floor = scores_bytes / bandwidth * 1e6
        topk_floor = topk_bytes / bandwidth * 1e6
        causal_pairs = rows * context if rows_per_seq == 1 else rows_per_seq * (rows_per_seq + 1) // 2
        tflops = 2 * causal_pairs * HEADS * HEAD_DIM / scores_us / 1e6
        out.append(dict(case=name, keys=kind, scores_us=scores_us, scores_mb=scores_bytes / 1e6,
                        scores_floor=scores_floor / scores_us, tflops=tflops, topk_us=topk_us,
                        topk_floor=topk_floor / topk_us, torch_topk_us=torch_topk_us,
                        best=(best, timings[best]) if args.sweep else None))
    agree = agreement(selections["bf16"], selections["fp8"], rows_pair[1], context)
    for row in out:
        row["agreement"] = agree
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time the scores kernel at SCORES_GRID's configs")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    bandwidth = copy_bandwidth()
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    _log(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bandwidth / 1e9:.0f} GB/s, L2 {l2_bytes >> 20} MiB")
    print("| case | keys | scores us | MB | % of floor | TFLOP/s | top-k us | % of floor | torch.topk us "
          "| fp8 keeps |" + (" best scores config |" if args.sweep else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.sweep else ""))
    for name in args.cases.split(","):
        for r in run_case(name, args, bandwidth, l2_bytes, gen):
            best = f" {r['best'][0]} {r['best'][1]:.1f} us |" if r["best"] else ""
            print(f"| {r['case']} | {r['keys']} | {r['scores_us']:.1f} | {r['scores_mb']:.1f} "
                  f"| {100 * r['scores_floor']:.0f}% | {r['tflops']:.0f} | {r['topk_us']:.1f} "
                  f"| {100 * r['topk_floor']:.0f}% | {r['torch_topk_us']:.1f} | {100 * r['agreement']:.2f}% |{best}",
                  flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
