"""Tiles of the bf16 grouped MoE GEMMs (layers/moe/triton_moe.py), swept on the GPU, and the table
the layer reads (layers/moe/tuned_moe_gemm.json).

For each model shape (experts, top-k, hidden, intermediate) and token count, every row-tile height
(block_m, the alignment both GEMMs share) gets the fastest (block_n, block_k, warps, stages) of a
grid for GEMM 1 (gate/up, with SiLU-and-mul in its epilogue or as a launch of its own after it)
and for GEMM 2 (down, times the routing weight); the block_m whose two best sum lowest is the
entry. Each figure is the median
over CUDA-graph replays of back-to-back calls (weights far larger than L2). Then the whole layer
(`fused_experts_triton`: alignment, both GEMMs, the sum over k) with the entry's tiles against the
rule's (what a shape without an entry runs: 64 x 32 tiles, SiLU-and-mul apart), and the HBM floor (every
expert that a token reaches read once, over the copy bandwidth).

    PYTHONPATH=. python3 benchmarks/moe_gemm_sweep.py [--models qwen3-30b-a3b,...] [--tokens 64,256]
        [--write-table metrale/layers/moe/tuned_moe_gemm.json] [--deadline-s 420]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from benchmarks.gemv_bench import copy_bandwidth, time_graph  # noqa: E402
from metrale.kernels.activation import silu_and_mul  # noqa: E402
from metrale.kernels.moe_align import align_assignments  # noqa: E402
from metrale.layers.moe import select_experts  # noqa: E402
from metrale.layers.moe import triton_moe as M  # noqa: E402

# name -> (experts, top_k, hidden, moe intermediate), from the shipped configs
MODELS = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-next-80b-a3b": (512, 10, 2048, 512),
    "glm-4.5-air": (128, 8, 4096, 1408),
    "minimax-m2": (256, 8, 3072, 1536),
}
TOKENS = [32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# (block_n, block_k, num_warps, num_stages)
GRID = [(32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 8, 3), (128, 64, 4, 3),
        (128, 64, 8, 3), (128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (256, 64, 8, 3), (256, 128, 8, 3),
        (64, 256, 4, 3), (32, 256, 4, 3), (128, 128, 4, 4), (64, 64, 4, 4),
        (64, 32, 4, 3)]  # the last: the rule's (layers/moe/triton_moe._rule_configs), so an entry never loses to it
CALLS, REPLAYS = 4, 6


def block_ms(rows_per_expert: float) -> list[int]:
    """Row-tile heights worth trying: 16 always; taller ones while padding stays within ~4x."""
    return [16] + [m for m in (32, 64, 128) if m <= max(16, 4 * rows_per_expert)]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def _compile_configs(configs: list[tuple[int, ...]]) -> int:
    """Launch both GEMMs once per config on a tiny problem whose arguments specialise as the real
    shapes' do (dims multiples of 256, top-k neither 1 nor a multiple of 16), filling Triton's
    on-disk cache for the sweep. Runs in a worker process."""
    experts, top_k, hidden, inter, tokens = 4, 2, 256, 256, 64
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k, "softmax", True)
    act = torch.empty(tokens * top_k, inter, device="cuda", dtype=torch.bfloat16)
    gate_up_out = torch.empty(tokens * top_k, 2 * inter, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16)
    done = 0
    for c in configs:
        cfg = M.MoeGemmConfig(*c)
        sorted_ids, block_expert = align_assignments(ids, cfg.block_m, experts)
        try:
            M._grouped_gemm(x, w13, act, None, sorted_ids, block_expert, top_k, cfg, silu_mul=True)
            M._grouped_gemm(x, w13, gate_up_out, None, sorted_ids, block_expert, top_k, cfg)
            M._grouped_gemm(act, w2, out, weights.reshape(-1).float(), sorted_ids, block_expert, 1, cfg)
            done += 1
        except Exception:  # out of shared memory: the sweep skips it too
            pass
    torch.cuda.synchronize()
    return done


def precompile(workers: int) -> None:
    import concurrent.futures
    import multiprocessing

    configs = [(bm, *g) for bm in (16, 32, 64, 128) for g in GRID]
    chunks = [configs[i::workers] for i in range(workers)]
    start = time.monotonic()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = sum(pool.map(_compile_configs, chunks))
    log(f"precompiled {done} of {len(configs)} configs in {time.monotonic() - start:.0f} s ({workers} processes)")


def sweep_shape(name, experts, top_k, hidden, inter, tokens_list, bw, deadline):
    torch.manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    entries, rows = [], []
    for tokens in tokens_list:
        if time.monotonic() > deadline:
            log(f"deadline: {name} stops before {tokens} tokens")
            break
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k, "softmax", True)
        num_assign = tokens * top_k
        flat_w = weights.reshape(-1).float().contiguous()
        act = torch.randn(num_assign, inter, device="cuda", dtype=torch.bfloat16)
        gate_up_out = torch.empty(num_assign, 2 * inter, device="cuda", dtype=torch.bfloat16)
        out = torch.zeros(num_assign, hidden, device="cuda", dtype=torch.bfloat16)
        best = None  # (sum us, block_m, gate_up cfg, gate_up us, down cfg, down us)
        for bm in block_ms(num_assign / experts):
            sorted_ids, block_expert = align_assignments(ids, bm, experts)
            picks = []
            for gemm in ("gate_up", "down"):
                timed = []
                fused = (True, False) if gemm == "gate_up" else (False,)
                for cfg in (M.MoeGemmConfig(bm, *g, fuse_silu=f) for g in GRID for f in fused):
                    if cfg.fuse_silu:
                        fn = lambda i, c=cfg: M._grouped_gemm(x, w13, act, None, sorted_ids, block_expert, top_k, c,
                                                              silu_mul=True)
                    elif gemm == "gate_up":  # GEMM 1, then SiLU-and-mul as its own launch
                        def fn(i, c=cfg):
                            M._grouped_gemm(x, w13, gate_up_out, None, sorted_ids, block_expert, top_k, c)
                            return silu_and_mul(gate_up_out)
                    else:
                        fn = lambda i, c=cfg: M._grouped_gemm(act, w2, out, flat_w, sorted_ids, block_expert, 1, c)
                    try:
                        timed.append((time_graph(fn, CALLS, REPLAYS), cfg))
                    except Exception as e:  # shared memory or registers
                        log(f"  {name} T={tokens} {gemm} {tuple(cfg)}: skipped ({type(e).__name__})")
                us, cfg = min(timed)
                picks += [cfg, us]
                log(f"  {name} T={tokens} block_m={bm} {gemm}: best {tuple(cfg)} {us:.1f} us "
                    f"(of {len(timed)}; worst {max(timed)[0]:.1f})")
            total = picks[1] + picks[3]
            if best is None or total < best[0]:
                best = (total, bm, *picks)
        _, bm, gu_cfg, gu_us, dn_cfg, dn_us = best
        # the whole layer: the table's tiles against the earlier path
        new = time_graph(lambda i: M.fused_experts_triton(x, w13, w2, weights, ids, configs=(gu_cfg, dn_cfg)),
                         CALLS, REPLAYS)
        rule = M._rule_configs(num_assign, experts, hidden, inter)  # the first heuristic: what runs untabled

        def earlier(i):
            return M.fused_experts_triton(x, w13, w2, weights, ids, configs=rule)

        old = time_graph(earlier, CALLS, REPLAYS)
        torch.testing.assert_close(M.fused_experts_triton(x, w13, w2, weights, ids, configs=(gu_cfg, dn_cfg)),
                                   earlier(0), rtol=2e-2, atol=2e-3)
        reached = int(torch.unique(ids).numel())
        floor = reached * 3 * hidden * inter * 2 / bw * 1e6
        rows.append((name, tokens, bm, gu_cfg, gu_us, dn_cfg, dn_us, new, old, floor))
        entries.append(dict(capability=list(torch.cuda.get_device_capability()), device=torch.cuda.get_device_name(),
                            experts=experts, top_k=top_k, hidden=hidden, intermediate=inter, dtype="bfloat16",
                            tokens=tokens, gate_up=list(gu_cfg), down=list(dn_cfg),
                            us=dict(gate_up=round(gu_us, 1), down=round(dn_us, 1), layer=round(new, 1),
                                    rule_layer=round(old, 1), floor=round(floor, 1))))
        log(f"{name} T={tokens}: layer {new:.1f} us (rule {old:.1f}, floor {floor:.1f})")
    del w13, w2
    torch.cuda.empty_cache()
    return entries, rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--write-table", help="write the entries here (replacing the file)")
    p.add_argument("--deadline-s", type=float, default=1e9, help="stop sweeping new cases after this many seconds")
    p.add_argument("--precompile", type=int, default=0, metavar="N",
                   help="compile the grid in N processes first (Triton's cache), then sweep")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_gemm_sweep.py needs a CUDA GPU; nothing measured.", file=sys.stderr)
        return 1
    if args.precompile:
        precompile(args.precompile)
    deadline = time.monotonic() + args.deadline_s
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    entries, rows = [], []
    for name in args.models.split(","):
        e, r = sweep_shape(name, *MODELS[name], [int(t) for t in args.tokens.split(",")], bw, deadline)
        entries += e
        rows += r
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; us per layer call (median of CUDA-graph replays)\n")
    print("| model | tokens | block_m | gate_up (n, k, warps, stages, fused SiLU) | us | down | us | layer | rule's layer "
          "| speed-up | floor | layer / floor |")
    print("|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, tokens, bm, gu, gu_us, dn, dn_us, new, old, floor in rows:
        print(f"| {name} | {tokens} | {bm} | {tuple(gu[1:])} | {gu_us:.1f} | {tuple(dn[1:5])} | {dn_us:.1f} | "
              f"{new:.1f} | {old:.1f} | {old / new:.2f}x | {floor:.1f} | {floor / new:.0%} |")
    if args.write_table:
        with open(args.write_table, "w") as f:
            json.dump({"about": "bf16 grouped MoE GEMM tiles, written by benchmarks/moe_gemm_sweep.py; "
                                "gate_up and down are (block_m, block_n, block_k, num_warps, num_stages, fuse_silu)",
                       "entries": entries}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
