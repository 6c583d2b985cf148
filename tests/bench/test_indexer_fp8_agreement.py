"""benchmarks/indexer_fp8_agreement.py's CPU smoke run, so that its first GPU run works: at small
indexer shapes (set on the module: its functions read them) it measures an agreement at or
above the 98% bar but below 1 (fp8 moves some picks), counts every selected position of the
rows it samples, and prints its JSON line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "indexer_fp8_agreement.py"
_spec = importlib.util.spec_from_file_location("indexer_fp8_agreement", BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

SMALL = dict(HIDDEN=256, Q_LORA_RANK=64, HEADS=16, HEAD_DIM=64, ROPE_DIM=32, TOPK=64)


def test_small_shapes_smoke_run_prints_the_agreement(monkeypatch, capsys):
    for name, value in SMALL.items():
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(sys, "argv", ["indexer_fp8_agreement.py", "--device", "cpu", "--contexts", "200", "320",
                                      "--rows", "24", "--chunk", "8", "--json"])
    try:
        bench.main()
    finally:
        torch.set_default_dtype(torch.float32)  # main() sets bfloat16 for the model dtype
    result = json.loads(capsys.readouterr().out)
    assert [c["selected"] for c in result["contexts"]] == [24 * 64, 24 * 64]  # rows past TOPK keep TOPK each
    assert 0.98 <= result["agreement"] < 1.0, result
