"""Gated DeltaNet kernel microbenchmark (metrale/kernels/causal_conv1d.py, gated_delta_rule.py, gated_delta_step.py) at
Qwen3-Next-80B / Qwen3.5 shapes: 16 key heads and 32 value heads of 128 (divided by --tp), conv
over 2 * 16 * 128 + 32 * 128 = 8192 channels, width 4, bf16 activations, fp32 recurrent state.

Cases:
  decode   the fused gating + delta-rule step and the conv step, at each --batch
  prefill  conv, gating and the chunked delta rule, at each --prefill (SEQSxLEN: 1x8192, 8x1024),
           every sequence continuing from a saved state
Each figure is µs per call and GB/s against the bytes the call must move (its inputs, outputs
and the states it reads and writes; the prefill kernels also move scratch, printed beside).
Decode steps are timed as --calls back-to-back calls in one CUDA graph (launch gaps as in the
engine's graph replay), each call on its own slots of a pool larger than L2, so every state comes
from HBM; the median over --replays graph replays, divided by --calls. Prefill is timed with
triton.testing.do_bench (it builds its chunk table on the host, so it is not graph-captured).
If flash-linear-attention (`fla`) is importable, the same shapes also run through its
`chunk_gated_delta_rule` (prefill) and `fused_recurrent_gated_delta_rule` (decode), given
precomputed g and beta and contiguous per-sequence states (it neither fuses the gating nor
updates slots in place; gathering its states is not timed). Prints a markdown table.

    PYTHONPATH=. python3 benchmarks/gdn_bench.py [--batch 1,8,64,256] [--prefill 1x8192,8x1024] [--tp 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_bench import copy_bandwidth, time_graph  # noqa: E402  (this directory's GEMV benchmark: the same timing)

KEY_HEADS, VALUE_HEADS, HEAD_DIM, CONV_WIDTH = 16, 32, 128, 4
L2_BYTES = 60 << 20  # above an H100/H200's L2: the decode pools are made larger than this
DEVICE = "cuda"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,8,64,256", help="decode batch sizes, comma-separated")
    p.add_argument("--prefill", default="1x8192,8x1024", help="prefill batches SEQSxLEN, comma-separated")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: heads and channels divided by it")
    p.add_argument("--state-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--calls", type=int, default=20, help="back-to-back decode calls per CUDA graph")
    p.add_argument("--replays", type=int, default=30, help="timed graph replays (the median is kept)")
    p.add_argument("--no-fla", action="store_true", help="skip flash-linear-attention even if importable")
    args = p.parse_args(argv)
    try:
        args.batch = [int(b) for b in args.batch.split(",") if b]
        args.prefill = [tuple(int(x) for x in c.lower().split("x")) for c in args.prefill.split(",") if c]
    except ValueError:
        p.error("--batch: integers; --prefill: SEQSxLEN items")
    if any(len(c) != 2 for c in args.prefill) or KEY_HEADS % args.tp or args.calls < 1 or args.replays < 1:
        p.error("bad --prefill, --tp (must divide 16), --calls or --replays")
    args.state_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.state_dtype]
    return args


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def _err(e):
    return f"{type(e).__name__}: {e}"[:80].replace("|", "/").replace("\n", " ")


def time_eager(fn):
    """Median µs of fn() with L2 flushed between calls (triton.testing.do_bench)."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1000.0


class Shapes:
    def __init__(self, tp):
        self.hk, self.hv, self.d = KEY_HEADS // tp, VALUE_HEADS // tp, HEAD_DIM
        self.key_dim = self.hk * self.d
        self.conv_dim = 2 * self.key_dim + self.hv * self.d


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # not installed, or broken on this GPU
        _log(f"fla not used: {type(e).__name__}: {e}")
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _split(y, s):
    """q, k, v as views of the conv output y [rows, conv_dim], as the layer splits it."""
    rows = y.shape[0]
    q = y[:, :s.key_dim].view(rows, s.hk, s.d)
    k = y[:, s.key_dim:2 * s.key_dim].view(rows, s.hk, s.d)
    v = y[:, 2 * s.key_dim:].view(rows, s.hv, s.d)
    return q, k, v


def _params(s):
    A = -(torch.rand(s.hv, device=DEVICE) * 2 - 1.5).exp()  # -exp(A), as the layer holds it
    dt_bias = torch.randn(s.hv, device=DEVICE, dtype=torch.bfloat16) * 0.5
    weight = torch.randn(s.conv_dim, CONV_WIDTH, device=DEVICE, dtype=torch.bfloat16) * 0.5
    return A, dt_bias, weight


def _calls_for(args, slot_bytes):
    """Back-to-back calls per graph (each on its own slots): at least --calls, and enough that the
    slots of one replay overflow L2 twice, so a call never finds its states there (at most 4096)."""
    return min(4096, max(args.calls, -(-2 * L2_BYTES // slot_bytes)))


def bench_decode(args, s, fla, rows):
    from metrale.kernels.causal_conv1d import causal_conv1d_step_triton
    from metrale.kernels.gated_delta_step import gated_delta_rule_step_triton, gdn_gating_triton

    A, dt_bias, weight = _params(s)
    state_bytes = s.hv * s.d * s.d * args.state_dtype.itemsize
    conv_state_bytes = s.conv_dim * (CONV_WIDTH - 1) * 2
    for n in args.batch:
        # the delta rule: call i updates slots [i * n, (i + 1) * n)
        calls = _calls_for(args, n * state_bytes)
        state = torch.randn(calls * n, s.hv, s.d, s.d, device=DEVICE).mul_(0.1).to(args.state_dtype)
        slot_sets = torch.arange(calls * n, device=DEVICE, dtype=torch.int32).view(calls, n)
        y = torch.randn(calls, n, s.conv_dim, device=DEVICE, dtype=torch.bfloat16)  # the conv outputs
        ab = torch.randn(calls, n, 2 * s.hv + 8, device=DEVICE, dtype=torch.bfloat16)  # a, b: strided views

        def gdn_step(i):
            q, k, v = _split(y[i], s)
            gated_delta_rule_step_triton(q, k, v, ab[i, :, :s.hv], ab[i, :, s.hv:2 * s.hv], A, dt_bias, state,
                                         slot_sets[i])

        need = 2 * n * state_bytes + n * (2 * s.key_dim + s.hv * s.d) * 2 + n * 2 * s.hv * 2 + n * s.hv * s.d * 2
        t = time_graph(gdn_step, calls, args.replays)
        rows.append((f"decode gdn step (gating fused) b={n}", t, need / t / 1e3, f"{calls} calls/graph"))
        if fla is not None:
            _, fused_recurrent = fla
            fla_calls = min(calls, max(2, -(-2 * L2_BYTES // (n * s.hv * s.d * s.d * 4))))
            h0 = [state[slot_sets[i].long()].float().contiguous() for i in range(fla_calls)]
            gates = [gdn_gating_triton(ab[i, :, :s.hv], ab[i, :, s.hv:2 * s.hv], A, dt_bias)
                     for i in range(fla_calls)]

            def fla_step(i):
                q, k, v = (t.unsqueeze(1) for t in _split(y[i], s))  # [B = n, T = 1, heads, dim]
                g, beta = gates[i]
                fused_recurrent(q, k, v, g=g.unsqueeze(1), beta=beta.unsqueeze(1), scale=s.d ** -0.5,
                                initial_state=h0[i], output_final_state=True, use_qk_l2norm_in_kernel=True)

            try:
                t = time_graph(fla_step, fla_calls, args.replays)
                rows.append((f"  fla fused_recurrent b={n}", t, need / t / 1e3, "gates precomputed, new state out"))
            except Exception as e:  # noqa: BLE001 - report and go on
                rows.append((f"  fla fused_recurrent b={n}", float("nan"), float("nan"), _err(e)))
            del h0, gates
        del state, y, ab

        # the conv step, with its own pool (a conv state is small: many more calls per graph)
        calls = _calls_for(args, n * conv_state_bytes)
        conv_state = torch.randn(calls * n, CONV_WIDTH - 1, s.conv_dim, device=DEVICE, dtype=torch.bfloat16)
        conv_state = conv_state.transpose(1, 2)  # [slots, channels, width - 1], channels contiguous
        slot_sets = torch.arange(calls * n, device=DEVICE, dtype=torch.int32).view(calls, n)
        x = torch.randn(calls, n, s.conv_dim + 2 * s.hv, device=DEVICE, dtype=torch.bfloat16)  # strided rows

        def conv_step(i):
            causal_conv1d_step_triton(x[i, :, :s.conv_dim], weight, None, conv_state, slot_sets[i])

        need = 2 * n * conv_state_bytes + 2 * n * s.conv_dim * 2 + s.conv_dim * CONV_WIDTH * 2
        t = time_graph(conv_step, calls, args.replays)
        rows.append((f"decode conv step b={n}", t, need / t / 1e3, f"{calls} calls/graph"))
        del conv_state, x
        torch.cuda.empty_cache()


def bench_prefill(args, s, fla, rows):
    from metrale.kernels.causal_conv1d import causal_conv1d_triton
    from metrale.kernels.gated_delta_rule import gated_delta_rule_triton
    from metrale.kernels.gated_delta_step import gdn_gating_triton

    A, dt_bias, weight = _params(s)
    for seqs, length in args.prefill:
        T = seqs * length
        starts = [i * length for i in range(seqs + 1)]
        qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        slots = torch.arange(seqs, dtype=torch.int32, device=DEVICE)
        has = torch.ones(seqs, dtype=torch.bool, device=DEVICE)
        state = torch.randn(seqs, s.hv, s.d, s.d, device=DEVICE).mul_(0.1).to(args.state_dtype)
        conv_state = torch.randn(seqs, CONV_WIDTH - 1, s.conv_dim, device=DEVICE, dtype=torch.bfloat16)
        conv_state = conv_state.transpose(1, 2)  # channels contiguous
        x = torch.randn(T, s.conv_dim, device=DEVICE, dtype=torch.bfloat16)
        ab = torch.randn(T, 2 * s.hv, device=DEVICE, dtype=torch.bfloat16)
        y = torch.nn.functional.silu(torch.randn(T, s.conv_dim, device=DEVICE, dtype=torch.bfloat16))
        q, k, v = _split(y, s)
        g, beta = gdn_gating_triton(ab[:, :s.hv], ab[:, s.hv:], A, dt_bias)
        name = f"{seqs}x{length}"

        t = time_eager(lambda: causal_conv1d_triton(x, weight, None, conv_state, qsl, slots, has,
                                                    query_start_cpu=starts))
        rows.append((f"prefill conv {name}", t, (2 * T * s.conv_dim * 2) / t / 1e3, ""))
        t = time_eager(lambda: gdn_gating_triton(ab[:, :s.hv], ab[:, s.hv:], A, dt_bias))
        rows.append((f"prefill gating {name}", t, (T * s.hv * (2 + 2 + 4 + 2)) / t / 1e3, ""))
        chunks = seqs * -(-length // 64)
        need = (T * (2 * s.key_dim + s.hv * s.d) * 2 + T * s.hv * (4 + 2) + T * s.hv * s.d * 2
                + 2 * seqs * s.hv * s.d * s.d * args.state_dtype.itemsize)
        scratch = T * s.hv * (4 * 3 + s.d * 2 * 2 + s.d * 2 * 4) + chunks * s.hv * s.d * s.d * 2 * 2
        t = time_eager(lambda: gated_delta_rule_triton(q, k, v, g, beta, state, qsl, slots, has,
                                                       query_start_cpu=starts))
        rows.append((f"prefill gdn {name}", t, need / t / 1e3, f"+{scratch / 2**20:.0f} MiB scratch"))
        if fla is not None:
            chunk_rule, _ = fla
            h0 = state.float().contiguous()
            cu = qsl.long()
            qf, kf, vf = (t.unsqueeze(0) for t in (q, k, v))
            note = ""
            try:
                chunk_rule(qf, kf, vf, g=g.unsqueeze(0), beta=beta.unsqueeze(0), scale=s.d ** -0.5,
                           initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
            except Exception:  # noqa: BLE001 - an fla without grouped value heads: repeat q, k
                r = s.hv // s.hk
                qf, kf = (t.repeat_interleave(r, dim=2) for t in (qf, kf))
                note = f"q, k repeated to {s.hv} heads"
            try:
                t = time_eager(lambda: chunk_rule(qf, kf, vf, g=g.unsqueeze(0), beta=beta.unsqueeze(0),
                                                  scale=s.d ** -0.5, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu))
                rows.append((f"  fla chunk_gated_delta_rule {name}", t, need / t / 1e3, note))
            except Exception as e:  # noqa: BLE001 - report and go on
                rows.append((f"  fla chunk_gated_delta_rule {name}", float("nan"), float("nan"), _err(e)))
        del state, conv_state, x, ab, y
        torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gdn_bench.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    s = Shapes(args.tp)
    fla = None if args.no_fla else _fla()
    bw = copy_bandwidth()
    print(f"# Gated DeltaNet kernels, {torch.cuda.get_device_name()}, tp={args.tp}: {s.hk} key / {s.hv} value heads "
          f"of {s.d}, conv {s.conv_dim} channels, state {str(args.state_dtype).split('.')[-1]}; "
          f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print()
    rows = []
    bench_decode(args, s, fla, rows)
    bench_prefill(args, s, fla, rows)
    print("| case | µs | GB/s (needed bytes) | % of copy | note |")
    print("|---|---:|---:|---:|---|")
    for name, t, gbs, note in rows:
        print(f"| {name} | {t:.1f} | {gbs:.0f} | {100 * gbs * 1e9 / bw:.0f}% | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
