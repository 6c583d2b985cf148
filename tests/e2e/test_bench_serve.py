"""`met bench serve` against a running server: every request completes, the figures add up, a
sweep runs each rate, goodput counts the requests within the SLOs, text prompts work."""

import argparse
import json

import pytest

from conftest import API_KEY
from metrale.bench import serve

SMALL = ["--num-prompts", "6", "--input-len-range", "3", "12", "--output-len-range", "2", "6",
         "--max-token-id", "300", "--max-concurrency", "3"]


def _args(server, *extra):
    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    return parser.parse_args(["--base-url", server.url, "--api-key", API_KEY, *SMALL, *extra])


def test_bench_serve_reports_latencies_and_throughput(api_server):
    result = serve.run(_args(api_server, "--request-rate", "50"))
    assert result["completed"] == 6 and result["failed"] == 0 and result["request_rate"] == 50
    assert result["output_token_throughput"] > 0 and result["request_throughput"] > 0
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert 0 < result[name]["median"] <= result[name]["p99"]
    assert result["e2e_s"]["mean"] >= result["ttft_s"]["mean"]
    assert "goodput" not in result


def test_bench_serve_sweep_and_goodput(api_server, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    result = serve.run(_args(api_server, "--request-rate", "100,inf", "--goodput", "e2e:600000", "tpot:600000",
                             "--output-json", str(out)))
    runs = result["runs"]
    assert [r["request_rate"] for r in runs] == [100, float("inf")]
    for r in runs:  # every request meets SLOs of ten minutes
        assert r["completed"] == 6 and r["goodput"] == pytest.approx(r["request_throughput"])
        assert r["slo_ms"] == {"e2e": 600000, "tpot": 600000}
    written = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert written["runs"][1]["completed"] == 6 and written["runs"][1]["request_rate"] == "inf"
    table = capsys.readouterr().out
    assert "| request rate |" in table and "goodput req/s" in table and "| inf |" in table
    strict = serve.run(_args(api_server, "--goodput", "ttft:0.001"))  # a microsecond to the first token
    assert strict["completed"] == 6 and strict["goodput"] == 0


def test_bench_serve_text_prompts(api_server, llama_checkpoint):
    # The form a server that takes string prompts only gets (transformers serve): decoded text, no ignore_eos.
    result = serve.run(_args(api_server, "--prompt-format", "text", "--tokenizer", str(llama_checkpoint),
                             "--no-ignore-eos"))
    assert result["completed"] == 6 and result["failed"] == 0
    assert 0 < result["output_token_throughput"]


@pytest.mark.parametrize("bad", [["--request-rate", "0"], ["--request-rate", "fast"], ["--goodput", "latency:5"],
                                 ["--goodput", "ttft:-1"]])
def test_bench_serve_refuses_bad_options(bad):
    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(bad)
