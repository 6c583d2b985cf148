"""Paged-attention microbenchmark: the Triton decode and extend kernels at the headline workloads'
shapes, at their default launch configs and a grid of alternatives.

Decode cases report microseconds per call and the KV bytes read over that time as a share of a
device-to-device copy measured at start; extend (prefill) cases report TFLOP/s of the causal
attention FLOPs. Every figure is the median over replays of a CUDA graph holding `--calls`
back-to-back calls. The batch-1 case cycles through enough distinct sequences (their own KV
blocks) that no call finds its keys in L2, as a decoder layer would not.

    PYTHONPATH=. python3 benchmarks/attention_bench.py [--cases thr256,bs1_8b,prefill_8x1024] [--default-only]
        [--kv-dtype fp8]

--kv-dtype fp8 stores the caches in e4m3 (q and the output stay bf16), as `--kv-cache-dtype fp8`
does, and adds 256-key tiles to the decode grid (the same bytes per tile as bf16's 128).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from benchmarks.gemv_bench import copy_bandwidth, time_graph  # noqa: E402

BLOCK_SIZE = 16
# name -> (kind, num_heads, num_kv_heads, head_dim, sequences, context range or new tokens)
CASES = {
    # Qwen3-0.6B (16 q heads, 8 kv heads) in the nano-vllm workload's decode steps
    "thr256": ("decode", 16, 8, 128, 256, (300, 1800)),
    "thr128": ("decode", 16, 8, 128, 128, (600, 2000)),
    "thr32": ("decode", 16, 8, 128, 32, (900, 2000)),
    # Qwen3-8B batch-1 decode of the latency benchmark (512 in, 128 out: contexts 513..640)
    "bs1_8b": ("decode", 32, 8, 128, 1, (576, 576)),
    # Qwen3-0.6B prefill steps: sequences x new tokens, no cached prefix
    "prefill_8x1024": ("extend", 16, 8, 128, 8, 1024),
    "prefill_16x512": ("extend", 16, 8, 128, 16, 512),
}
# (BLOCK_N, num_warps, num_stages); (BLOCK_N, num_warps, num_stages, splits) for batch 1. The
# default (the kernel's own choice) is timed first in every case.
DECODE_GRID = [(64, 4, 3), (64, 4, 2), (64, 4, 1), (128, 4, 2), (128, 4, 3), (128, 8, 2), (64, 2, 2), (128, 2, 2)]
FP8_DECODE_GRID = DECODE_GRID + [(128, 4, 4), (128, 8, 3), (256, 4, 2), (256, 8, 2), (256, 8, 3)]
BS1_GRID = [(64, 4, 3, 16), (64, 4, 2, 16), (64, 4, 1, 8), (64, 4, 1, 32), (64, 2, 1, 16), (32, 4, 1, 16),
            (32, 2, 1, 32)]
# (BLOCK_M, BLOCK_N, num_warps, num_stages)
EXTEND_GRID = [(128, 64, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 32, 4, 3), (128, 32, 4, 3),
               (64, 64, 4, 2), (64, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2)]


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def _paged(n_seqs, lengths, num_kv_heads, head_dim, dtype, gen, kv_dtype=None):
    """K/V caches (kv_dtype, default dtype) holding each sequence in its own shuffled blocks, and
    the block table."""
    blocks_per = [-(-n // BLOCK_SIZE) for n in lengths]
    total = sum(blocks_per)
    perm = torch.randperm(total, generator=gen, device="cpu").to(torch.int32)
    width = max(blocks_per)
    table = torch.zeros(n_seqs, width, dtype=torch.int32)
    at = 0
    for i, b in enumerate(blocks_per):
        table[i, :b] = perm[at:at + b]
        at += b
    shape = (total, BLOCK_SIZE, num_kv_heads, head_dim)
    k = torch.randn(shape, dtype=dtype, device="cuda").to(kv_dtype or dtype)
    v = torch.randn(shape, dtype=dtype, device="cuda").to(kv_dtype or dtype)
    return k, v, table.cuda()


def _sweep(name, configs, make_fn, calls, replays, describe):
    """{config: us per call} of make_fn(config)(i), each config's output checked against the
    first's; a config that fails to compile or run is logged and skipped."""
    ref, out = None, {}
    for cfg in configs:
        fn = make_fn(cfg)
        try:
            got = fn(0)
            ref = got if ref is None else ref
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
            us = time_graph(fn, calls, replays)
        except Exception as e:
            _log(f"  {name} {cfg}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
            continue
        out[cfg] = us
        _log(f"  {name} {cfg}: {describe(us)}")
    return out


def run_decode(name, heads, kv_heads, d, n_seqs, ctx, configs, dtype, bw, calls, replays, kv_dtype):
    from metrale.kernels.paged_attention import _decode_config, choose_num_kv_splits, decode_attention_triton

    rnd = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    batch1 = n_seqs == 1
    # batch 1: one distinct sequence per call in the graph, so its keys are never L2-resident
    n_alloc = calls if batch1 else n_seqs
    lengths = [rnd.randint(*ctx) for _ in range(n_alloc)]
    k, v, table = _paged(n_alloc, lengths, kv_heads, d, dtype, gen, kv_dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(n_alloc, heads, d, dtype=dtype, device="cuda")
    scale = d ** -0.5
    if batch1:  # the engine's graph pads the block table to the model's 4096-token capacity
        wide = torch.zeros(n_alloc, 4096 // BLOCK_SIZE, dtype=torch.int32, device="cuda")
        wide[:, :table.shape[1]] = table
        table = wide
        kv_bytes = 2 * sum(lengths) / n_alloc * kv_heads * d * kv_dtype.itemsize
    else:
        kv_bytes = 2 * sum(lengths) * kv_heads * d * kv_dtype.itemsize

    def make_fn(cfg):
        kernel_cfg, splits = (cfg[:3], cfg[3]) if cfg is not None and len(cfg) == 4 else (cfg, None)
        if batch1:
            return lambda i: decode_attention_triton(q[i:i + 1], k, v, table[i:i + 1], seq_lens[i:i + 1], scale,
                                                     num_kv_splits=splits, config=kernel_cfg)
        return lambda i: decode_attention_triton(q, k, v, table, seq_lens, scale, num_kv_splits=splits,
                                                 config=kernel_cfg)

    out = _sweep(name, configs, make_fn, calls, replays,
                 lambda us: f"{us:.2f} us, {kv_bytes / us / 1e6 / bw * 1e12:.1%} of copy bandwidth")
    splits = choose_num_kv_splits(n_seqs, kv_heads, table.shape[1] * BLOCK_SIZE, q.device)  # as the kernel picks
    default = (*_decode_config(d, n_seqs, kv_heads, splits, q.device), splits)
    return out, kv_bytes, default


def run_extend(name, heads, kv_heads, d, n_seqs, new_tokens, configs, dtype, calls, replays):
    from metrale.kernels.paged_attention import extend_attention_triton

    gen = torch.Generator().manual_seed(0)
    lengths = [new_tokens] * n_seqs
    k, v, table = _paged(n_seqs, lengths, kv_heads, d, dtype, gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0] + [new_tokens * (i + 1) for i in range(n_seqs)], dtype=torch.int32, device="cuda")
    q = torch.randn(n_seqs * new_tokens, heads, d, dtype=dtype, device="cuda")
    flops = 4 * heads * d * n_seqs * new_tokens * (new_tokens + 1) / 2  # QK^T and PV over the causal half

    def make_fn(cfg):
        return lambda i: extend_attention_triton(q, k, v, table, cu, seq_lens, new_tokens, d ** -0.5, config=cfg)

    out = _sweep(name, configs, make_fn, calls, replays, lambda us: f"{us:.1f} us, {flops / us / 1e6:.1f} TFLOP/s")
    return out, flops


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated names from: " + ", ".join(CASES))
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--default-only", action="store_true")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="the caches' dtype (decode cases)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_bench.py needs a CUDA GPU; nothing measured.", file=sys.stderr)
        return 1
    from metrale.kernels.paged_attention import _extend_config

    dtype = torch.bfloat16
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else dtype
    bw = copy_bandwidth()
    t0 = time.time()
    print(f"# {torch.cuda.get_device_name(0)}; copy bandwidth {bw / 1e12:.2f} TB/s; bf16, {args.kv_dtype} KV; "
          f"median of {args.replays} replays of {args.calls} calls\n")
    print("| case | config | time | figure |\n|---|---|---|---|")
    for name in filter(None, args.cases.split(",")):
        kind, heads, kv_heads, d, n_seqs, size = CASES[name]
        if kind == "decode":
            grid = BS1_GRID if n_seqs == 1 else FP8_DECODE_GRID if args.kv_dtype == "fp8" else DECODE_GRID
            configs = [None] + ([] if args.default_only else grid)  # None: the kernel's own choice
            res, kv_bytes, default = run_decode(name, heads, kv_heads, d, n_seqs, size, configs, dtype, bw,
                                                args.calls, args.replays, kv_dtype)
            for cfg, us in sorted(res.items(), key=lambda kv: kv[1]):
                label = f"default {default}" if cfg is None else str(cfg)
                print(f"| {name} | {label} | {us:.2f} us | {kv_bytes / us / 1e6 / bw * 1e12:.1%} of copy BW |")
        else:
            default = _extend_config(d, size * heads // kv_heads)
            configs = list(dict.fromkeys([default] + ([] if args.default_only else EXTEND_GRID)))
            res, flops = run_extend(name, heads, kv_heads, d, n_seqs, size, configs, dtype, args.calls, args.replays)
            for cfg, us in sorted(res.items(), key=lambda kv: kv[1]):
                tag = " (default)" if cfg == default else ""
                print(f"| {name} | {cfg}{tag} | {us:.1f} us | {flops / us / 1e6:.1f} TFLOP/s |")
        sys.stdout.flush()
    _log(f"attention_bench: {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
