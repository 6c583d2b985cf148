"""`met bench latency`'s spread of TTFT and TPOT over the iterations: p50 (the median, as
`ttft_s` / `tpot_s`), p99, min and max in the report and the JSON, and a warning when too few
iterations ran for a p99 to be more than the max."""

import json
import statistics

import numpy as np
import pytest

from metrale.bench.latency import few_iterations_warning, percentile, summarize
from metrale.entrypoints.cli import main


@pytest.mark.parametrize("values", [[0.5], [2.0, 1.0], [0.3, 0.1, 0.2], [float(v) for v in range(37, 0, -3)],
                                    [0.01 * ((7 * i) % 101) for i in range(250)]])
def test_percentiles_match_numpy(values):
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile(values, 50) == pytest.approx(statistics.median(values))


def test_summary_keys_and_values():
    got = summarize([0.4, 0.1, 0.3, 0.2], "ttft")
    assert got == pytest.approx({"ttft_p50_s": 0.25, "ttft_p99_s": 0.397, "ttft_min_s": 0.1, "ttft_max_s": 0.4})


def test_few_iterations_warning():
    assert few_iterations_warning(3) == ("  warning: p99 of 3 iterations is the max, near enough; "
                                         "pass --num-iters 10 or more for a tail")
    assert "p99 of 1 iteration is" in few_iterations_warning(1)
    assert few_iterations_warning(9) is not None
    assert few_iterations_warning(10) is None


def test_report_and_json_carry_the_spread(checkpoint_factory, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", checkpoint_factory("llama"), "--device", "cpu", "--batch-size", "1",
                 "--input-len", "8", "--output-len", "3", "--num-iters", "2", "--num-iters-warmup", "0",
                 "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    for name in ("ttft", "tpot"):
        per_iter = result[f"{name}_per_iter_s"]
        assert len(per_iter) == 2
        assert result[f"{name}_s"] == result[f"{name}_p50_s"] == pytest.approx(statistics.median(per_iter))
        assert result[f"{name}_min_s"] == min(per_iter) <= result[f"{name}_p99_s"] <= result[f"{name}_max_s"] == max(per_iter)
    assert "p99 of 2 iterations is the max" in printed
    assert "over 2 iterations:" in printed and printed.count("  p99 ") == 2
