"""benchmarks/indexer_bench.py's CPU-safe parts, so that its first GPU run works: the fp8/bf16
agreement measure on a hand-made selection, and the interpreter smoke run of every case (keys
written, scores and top-k timed, torch.topk, agreement, one table line per case and key dtype)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "indexer_bench.py"
_spec = importlib.util.spec_from_file_location("indexer_bench", BENCH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["indexer_bench"] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)


def test_agreement_counts_kept_positions_of_sparse_rows_only():
    bf16 = torch.tensor([[0, 3, 5, 7], [1, 2, -1, -1], [4, 6, 8, 9]], dtype=torch.int32)
    fp8 = torch.tensor([[7, 5, 2, 0], [0, 1, -1, -1], [9, 8, 6, 4]], dtype=torch.int32)
    # row 1 sees 2 positions (< index_topk 4): left out; rows 0 and 2 keep 3 and 4 of 4
    assert bench.agreement(bf16, fp8, torch.tensor([10, 1, 10]), 11, 4) == 7 / 8


def test_cpu_smoke_runs_every_case(capsys):
    assert bench.main(["--cpu-smoke", "--sweep", "--calls", "1", "--replays", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split(" | ")[:2] for line in lines if line.startswith("| ") and not line.startswith("| case")]
    assert rows == [[f"| {case}", keys] for case in bench.smoke_setup().cases for keys in ("bf16", "fp8")]
