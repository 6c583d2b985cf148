"""benchmarks/mla_decode_bench.py's CPU-safe parts, so that its first GPU run works: the byte
floors at DeepSeek-V3's shapes, the L2 rotation, the interpreter smoke run, and one batch's whole
sweep with a stand-in timer (every config launches, each line and the JSON fields come out)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "mla_decode_bench.py"
_spec = importlib.util.spec_from_file_location("mla_decode_bench", BENCH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["mla_decode_bench"] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)


def test_floor_bytes_at_deepseek_v3_shapes():
    shape = bench.Shape()
    kernel, decode = bench.floor_bytes(shape, 1, 4096, 2)
    cache = 4096 * 576 * 2
    assert kernel == cache + 128 * 576 * 2 + 128 * 512 * 2
    assert decode == cache + 128 * 256 * 512 * 2 + 128 * 192 * 2 + 128 * 128 * 2
    assert bench.floor_bytes(shape, 256, 4096, 1)[0] < bench.floor_bytes(shape, 256, 4096, 2)[0]
    sets, weight_sets = bench.rotation_sets(shape, 1, 4096, 2)
    assert sets * kernel >= 2 * bench.L2_BYTES and weight_sets * 128 * 256 * 512 * 2 >= 2 * bench.L2_BYTES
    assert bench.rotation_sets(shape, 256, 4096, 2)[0] == 1


def test_cpu_smoke_runs():
    assert bench.main(["--cpu-smoke"]) == 0


def test_sweep_of_one_batch_launches_every_config():
    calls = []

    def fake_time_graph(fn, n, replays):
        for i in range(n):
            fn(i)
        calls.append(n)
        return 10.0

    args = argparse.Namespace(context=37, kv_dtype="bf16", sweep=True, calls=2, replays=1, hbm_tbps=4.3,
                              l2_mib=0.01)
    shape = bench.Shape(heads=16, rank=32, rope=16, nope=16, v=16, block_size=4)
    results = bench.run_batch(args, shape, 2, 1e12, fake_time_graph, device=torch.device("cpu"))
    kernels = [r for r in results if r.what == "kernel"]
    # the default (first in SWEEP), the others, then the default at twice the split count (1 here)
    assert len(kernels) == len(bench.SWEEP) + 1 and kernels[-1].splits == 2
    assert [r.what for r in results].count("decode") == 1 and [r.what for r in results].count("bmms") == 1
    assert all(r.us == 10.0 and 0 < r.of_floor and r.bytes > 0 for r in results)
    assert all(n >= 2 for n in calls)  # two sets rotate through 10 KiB of "L2"
    assert "of floor" in bench.fmt(results[0])


def test_configs_option_parses_variants_and_refuses_unknown_ones():
    assert bench.parse_configs("64x32x8x2xsplit_v, 32x64x8x2") == [(64, 32, 8, 2, "split_v"), (32, 64, 8, 2)]
    assert any(len(c) == 5 for c in bench.SWEEP)  # the sweep times the 64-row variants too
    for bad in ("64x32x8", "64x32x8x2xwide", "64xAx8x2"):
        try:
            bench.parse_configs(bad)
        except ValueError as e:
            assert bad in str(e)
        else:
            raise AssertionError(f"{bad} was accepted")
