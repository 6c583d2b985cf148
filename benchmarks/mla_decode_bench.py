"""MLA absorbed-decode microbenchmark at DeepSeek-V3's shapes (128 heads, kv_lora_rank 512, rope 64,
qk_nope 128, v 128, bf16 latent cache of blocks of 16): the Triton decode kernel alone
(kernels/mla_decode.py: split-KV MQA over the paged latents, with its merge) and the whole
absorbed decode of one layer (q_nope @ W_UK, the kernel, attended @ W_UV^T), at batch 1, 64 and
256 over 4k-token contexts.

Each figure is the median over replays of a CUDA graph of `--calls` back-to-back calls; the calls
rotate over enough distinct sequences and weight copies (a decoder layer's own) that no call
finds its latents or W_UK / W_UV in L2 (50 MiB on an H200). Bytes are the fewest any version must
move: the latent cache entries read once, q read, the attended latent written (kernel), plus
W_UK and W_UV read, q_nope read and the heads written (whole decode); the two bmms alone are
timed too ("bmms"), so the decode's time splits into kernel and projections. The floor is bytes over
--hbm-tbps (4.3 TB/s, the H200's HBM3e at the rate a copy reaches), and over the measured
device-to-device copy rate too. Before timing, each batch's kernel output is checked against a
float32 PyTorch computation (first and last rows).

    PYTHONPATH=. python3 benchmarks/mla_decode_bench.py [--batches 1,64,256] [--context 4096]
        [--sweep] [--kv-dtype bf16|fp8] [--output-json FILE]
    PYTHONPATH=. TRITON_INTERPRET=1 python3 benchmarks/mla_decode_bench.py --cpu-smoke
        # tiny shapes through the interpreter: the check and the byte counts, no timing

`--sweep` also times the kernel at each (BLOCK_H, BLOCK_N, num_warps, num_stages[, variant]) of
SWEEP (the variants: kernels/mla_decode.py's VARIANTS) and at half and twice the chosen split
count, printing one line each. `--configs 64x32x8x2xsplit_v,...` times those instead of SWEEP.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from metrale.kernels import mla_decode as D  # noqa: E402

FP8 = torch.float8_e4m3fn
L2_BYTES = 50 * 2**20
# Tried by --sweep after the module's default: (BLOCK_H, BLOCK_N, num_warps, num_stages[, variant]).
# 64 heads of the whole latent, and 16 heads x 64 tokens x 4 warps, spill registers at sm_90
# (tests/kernels/compile_sm90.py): there for the record. The variants (kernels/mla_decode.py's
# VARIANTS) are the 64-row wgmma candidates: split_v 64 x 32 x 8 compiles to wgmma without spills
# through the merge and direct, 128 x 32 x 8 through the merge (direct spills one register);
# split_v 64 x 64 x 8 spills direct, "halves" spills (STACK 48 direct, 192 with the merge).
SWEEP = [(32, 32, 8, 2), (32, 32, 8, 3), (32, 32, 8, 1), (32, 64, 8, 2), (32, 16, 4, 2), (32, 32, 4, 2),
         (16, 32, 4, 2), (16, 64, 8, 2), (16, 32, 4, 3), (64, 32, 8, 2), (64, 16, 8, 2),
         (64, 32, 8, 2, "split_v"), (64, 32, 8, 3, "split_v"), (64, 16, 8, 2, "split_v"), (64, 64, 8, 2, "split_v"),
         (128, 32, 8, 2, "split_v"), (128, 32, 8, 3, "split_v"), (64, 32, 8, 2, "halves")]


@dataclass(frozen=True)
class Shape:
    heads: int = 128
    rank: int = 512
    rope: int = 64
    nope: int = 128
    v: int = 128
    block_size: int = 16


@dataclass
class Result:
    batch: int
    what: str  # kernel | decode
    config: str
    splits: int
    us: float
    bytes: int
    floor_us: float
    of_floor: float  # floor / measured
    of_copy: float  # bytes / measured over the measured copy rate


def floor_bytes(shape: Shape, batch: int, context: int, kv_bytes: int, act_bytes: int = 2) -> tuple[int, int]:
    """(kernel bytes, whole-decode bytes): each input read once, each output written once."""
    h = shape.heads
    cache = batch * context * (shape.rank + shape.rope) * kv_bytes
    kernel = cache + batch * h * (shape.rank + shape.rope) * act_bytes + batch * h * shape.rank * act_bytes
    weights = h * (shape.nope + shape.v) * shape.rank * act_bytes
    decode = (cache + weights + batch * h * (shape.nope + shape.rope) * act_bytes  # q_nope and q_pe in
              + batch * h * shape.v * act_bytes)  # the heads out
    return kernel, decode


def rotation_sets(shape: Shape, batch: int, context: int, kv_bytes: int, l2_bytes: int = L2_BYTES) -> tuple[int, int]:
    """(sequence sets, weight copies) to cycle through so that a call's latents, and its W_UK /
    W_UV, left L2 since their last use: twice L2's bytes of each between two uses."""
    kernel = floor_bytes(shape, batch, context, kv_bytes)[0]
    weights = shape.heads * (shape.nope + shape.v) * shape.rank * 2
    return max(1, math.ceil(2 * l2_bytes / kernel)), max(1, math.ceil(2 * l2_bytes / weights))


class Inputs:
    """`sets` independent (sequences, queries) over one paged cache, blocks shuffled, and
    `weight_sets` copies of W_UK / W_UV. Random values (never zeros), drawn on the device."""

    def __init__(self, shape: Shape, batch: int, context: int, sets: int, kv_dtype, device, weight_sets=1, seed=0):
        torch.manual_seed(seed)
        g = torch.Generator(device="cpu").manual_seed(seed)
        s, dtype = shape, torch.bfloat16 if device.type == "cuda" else torch.float32
        blocks_per_seq = -(-context // s.block_size)
        num_blocks = sets * batch * blocks_per_seq
        latent = torch.randn(num_blocks, s.block_size, s.rank + s.rope, device=device, dtype=dtype)
        self.cache = latent.to(kv_dtype) if kv_dtype == FP8 else latent.to(dtype)
        del latent
        order = torch.randperm(num_blocks, generator=g).to(device=device, dtype=torch.int32)
        self.tables = order.view(sets, batch, blocks_per_seq)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)

        def rand(*size):
            return torch.randn(*size, device=device, dtype=dtype)

        self.q_nope = [rand(batch, s.heads, s.nope) for _ in range(sets)]
        self.q_pe = [rand(batch, s.heads, s.rope) for _ in range(sets)]
        self.q_latent = [rand(batch, s.heads, s.rank) for _ in range(sets)]
        self.w_uk = [rand(s.heads, s.nope, s.rank) * s.rank ** -0.5 for _ in range(weight_sets)]
        self.w_uv = [rand(s.heads, s.v, s.rank) * s.rank ** -0.5 for _ in range(weight_sets)]
        self.scale = (s.nope + s.rope) ** -0.5
        self.sets = sets


def kernel_call(inp: Inputs, i: int, config=None, splits=None):
    k = i % inp.sets
    return D.mla_decode_attention(inp.q_latent[k], inp.q_pe[k], inp.cache, inp.tables[k], inp.seq_lens, inp.scale,
                                  config=config, num_kv_splits=splits)


def decode_call(inp: Inputs, i: int):
    """The whole absorbed decode of one layer, as layers/mla/triton_backend.py runs it."""
    k, w = i % inp.sets, i % len(inp.w_uk)
    q_latent = torch.bmm(inp.q_nope[k].transpose(0, 1), inp.w_uk[w]).transpose(0, 1)
    attended = D.mla_decode_attention(q_latent, inp.q_pe[k], inp.cache, inp.tables[k], inp.seq_lens, inp.scale)
    return torch.bmm(attended.transpose(0, 1), inp.w_uv[w].transpose(1, 2)).transpose(0, 1)


def bmm_call(inp: Inputs, i: int):
    """The whole decode's two bmms alone (the kernel's input and output stand in: q_latent's
    shape), so the decode's time splits into kernel and projections."""
    k, w = i % inp.sets, i % len(inp.w_uk)
    q_latent = torch.bmm(inp.q_nope[k].transpose(0, 1), inp.w_uk[w])
    return torch.bmm(q_latent, inp.w_uv[w].transpose(1, 2))


def bmm_bytes(shape: Shape, batch: int, act_bytes: int = 2) -> int:
    h = shape.heads
    return (h * (shape.nope + shape.v) * shape.rank * act_bytes + batch * h * shape.nope * act_bytes
            + 2 * batch * h * shape.rank * act_bytes + batch * h * shape.v * act_bytes)


def check(inp: Inputs, shape: Shape, config=None) -> float:
    """Largest relative error of the kernel's rows 0 and B-1 against float32 PyTorch."""
    out = kernel_call(inp, 0, config).float()
    worst = 0.0
    for row in sorted({0, out.shape[0] - 1}):
        n = int(inp.seq_lens[row])
        pos = torch.arange(n, device=inp.cache.device)
        blocks = inp.tables[0, row].long()[pos // shape.block_size]
        entries = inp.cache[blocks, pos % shape.block_size].float()
        q = torch.cat((inp.q_latent[0][row], inp.q_pe[0][row]), -1).float()
        ref = torch.softmax(q @ entries.T * inp.scale, -1) @ entries[:, :shape.rank]
        worst = max(worst, ((out[row] - ref).norm() / ref.norm()).item())
    if not math.isfinite(worst):
        raise RuntimeError("the kernel wrote NaN or inf")
    return worst


def chosen_splits(inp: Inputs, shape: Shape, config=None) -> int:
    """The split count mla_decode_attention picks for `config` (None: the module's default)."""
    block_h = max(16, min(config[0] if config else D.BLOCK_H, 1 << (shape.heads - 1).bit_length()))
    v_programs = D.VARIANTS[config[4]] if config and len(config) > 4 else None
    return D.choose_num_kv_splits(inp.seq_lens.shape[0], -(-shape.heads // block_h) * (v_programs or 1),
                                  inp.tables.shape[2] * shape.block_size, inp.cache.device)


def run_batch(args, shape: Shape, batch: int, copy_rate: float, time_graph, device=torch.device("cuda")) -> list[Result]:
    """`time_graph(fn, calls, replays)` -> us per call (gemv_bench's; tests pass a stand-in)."""
    kv_dtype = FP8 if args.kv_dtype == "fp8" else torch.bfloat16
    kv_bytes = 1 if kv_dtype == FP8 else 2
    sets, weight_sets = rotation_sets(shape, batch, args.context, kv_bytes, int(args.l2_mib * 2**20))
    inp = Inputs(shape, batch, args.context, sets, kv_dtype, device, weight_sets)
    err = check(inp, shape)
    print(f"batch {batch}: {sets} rotating sequence set(s), {weight_sets} weight copies, kernel vs float32 "
          f"rel. error {err:.2e}", flush=True)
    if err > 2e-2:
        print(f"batch {batch}: ERROR, the kernel's output is wrong (rel. error {err:.2e} > 2e-2)", flush=True)
    kernel_bytes, decode_bytes = floor_bytes(shape, batch, args.context, kv_bytes)
    default = D.default_config(batch, shape.heads, inp.cache.dtype, mapped_or_sparse=False)
    splits = chosen_splits(inp, shape, default)
    calls = max(sets, weight_sets, args.calls)

    def result(what, config, n_splits, us, nbytes):
        floor_us = nbytes / (args.hbm_tbps * 1e12) * 1e6
        return Result(batch, what, config, n_splits, us, nbytes, floor_us, floor_us / us, nbytes / (us * 1e-6) / copy_rate)

    trials = [(default, None)]
    if args.sweep:
        sweep = parse_configs(args.configs) if getattr(args, "configs", None) else SWEEP
        trials += [(c, None) for c in sweep if c != default]
        trials += [(default, s) for s in sorted({max(1, splits // 2), min(D.MAX_KV_SPLITS, splits * 2)} - {splits})]
    results = []
    for config, n_splits in trials:
        name = "default" if (config, n_splits) == (default, None) else "x".join(map(str, config))
        try:
            if n_splits is None and config != default and len(config) > 4:
                # a variant's compiled code is checked here first: the interpreter's tests run
                # its Python semantics only
                err = check(inp, shape, config)
                if err > 2e-2:
                    print(f"batch {batch} kernel {name}: ERROR, wrong output (rel. error {err:.2e})", flush=True)
            us = time_graph(lambda i: kernel_call(inp, i, config, n_splits), calls, args.replays)
            results.append(result("kernel", name, n_splits or chosen_splits(inp, shape, config), us, kernel_bytes))
        except Exception as e:  # noqa: BLE001 - a config that cannot build is reported, the others still run
            print(f"batch {batch} kernel {name} splits {n_splits or splits}: FAILED {type(e).__name__}: "
                  f"{str(e)[:300]}", flush=True)
            continue
        print(fmt(results[-1]), flush=True)
    for what, call, nbytes in (("decode", decode_call, decode_bytes), ("bmms", bmm_call, bmm_bytes(shape, batch))):
        try:
            us = time_graph(lambda i: call(inp, i), calls, args.replays)
            results.append(result(what, "default", splits, us, nbytes))
            print(fmt(results[-1]), flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"batch {batch} {what}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    del inp
    torch.cuda.empty_cache()
    return results


def parse_configs(text: str) -> list[tuple]:
    """'64x32x8x2xsplit_v,32x64x8x2' -> [(64, 32, 8, 2, 'split_v'), (32, 64, 8, 2)]."""
    configs = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) not in (4, 5) or not all(p.isdigit() for p in parts[:4]) or (
                len(parts) == 5 and parts[4] not in D.VARIANTS):
            raise ValueError(f"config {item!r}: want BLOCK_HxBLOCK_NxWARPSxSTAGES[x{'|'.join(D.VARIANTS)}]")
        configs.append(tuple(int(p) for p in parts[:4]) + tuple(parts[4:]))
    return configs


def fmt(r: Result) -> str:
    return (f"B={r.batch:<4} {r.what:<6} {r.config:<20} splits {r.splits:<3} {r.us:9.2f} us  "
            f"{r.bytes / 1e6:9.2f} MB  floor {r.floor_us:8.2f} us  {100 * r.of_floor:5.1f}% of floor  "
            f"{100 * r.of_copy:5.1f}% of copy")


def cpu_smoke() -> int:
    """Tiny shapes through the interpreter: the check and the byte counts, nothing timed."""
    from metrale.kernels import interpret_mode

    if not interpret_mode():
        print("--cpu-smoke needs TRITON_INTERPRET=1 (set before Python starts)", file=sys.stderr)
        return 2
    shape = Shape(heads=16, rank=32, rope=16, nope=16, v=16, block_size=4)
    for batch in (1, 3):
        inp = Inputs(shape, batch, 37, 2, torch.float32, torch.device("cpu"), weight_sets=2)
        err = max([check(inp, shape)] + [check(inp, shape, (16, 16, 4, 1, v)) for v in D.VARIANTS])
        out = decode_call(inp, 1)
        assert out.shape == (batch, shape.heads, shape.v) and torch.isfinite(out).all()
        print(f"cpu smoke batch {batch}: rel. error {err:.1e}, bytes {floor_bytes(shape, batch, 37, 4)}, "
              f"splits {chosen_splits(inp, shape)}")
        if err > 1e-4:
            return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--configs", help="with --sweep: these configs instead of SWEEP, e.g. 64x32x8x2xsplit_v")
    parser.add_argument("--calls", type=int, default=8, help="calls per graph (at least the rotation's sets)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--hbm-tbps", type=float, default=4.3)
    parser.add_argument("--l2-mib", type=float, default=L2_BYTES / 2**20, help="L2 to keep the rotation out of")
    parser.add_argument("--pdl", action="store_true", help="programmatic dependent launch (kernel -> merge)")
    parser.add_argument("--output-json")
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        return cpu_smoke()
    if not torch.cuda.is_available():
        print("mla_decode_bench times CUDA kernels: no CUDA device here (--cpu-smoke checks the rest)",
              file=sys.stderr)
        return 2
    from benchmarks.gemv_bench import copy_bandwidth, time_graph
    from metrale.kernels import set_programmatic_launch

    set_programmatic_launch(args.pdl)
    copy_rate = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device copy {copy_rate / 1e12:.2f} TB/s; floor at {args.hbm_tbps} TB/s; "
          f"defaults BLOCK_H {D.BLOCK_H} BLOCK_N {D.BLOCK_N} warps {D.NUM_WARPS} stages {D.NUM_STAGES}", flush=True)
    shape, results = Shape(), []
    for batch in (int(b) for b in args.batches.split(",")):
        try:
            results += run_batch(args, shape, batch, copy_rate, time_graph)
        except Exception as e:  # noqa: BLE001 - one batch's failure (memory) leaves the others
            print(f"batch {batch}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            torch.cuda.empty_cache()
    print("\nsummary (median us per call, CUDA graph of back-to-back calls, L2 cold):")
    for r in results:
        if r.config == "default":
            print(fmt(r))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
