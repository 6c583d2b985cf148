"""`met bench serve` against a running server: every request completes, the figures add up."""

import argparse

from conftest import API_KEY
from metrale.bench import serve


def test_bench_serve_reports_latencies_and_throughput(api_server, tmp_path):
    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    args = parser.parse_args(["--base-url", api_server.url, "--api-key", API_KEY, "--num-prompts", "6",
                              "--input-len-range", "3", "12", "--output-len-range", "2", "6",
                              "--max-token-id", "300", "--max-concurrency", "3", "--request-rate", "50"])
    result = serve.run(args)
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["output_token_throughput"] > 0 and result["request_throughput"] > 0
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert 0 < result[name]["median"] <= result[name]["p99"]
    assert result["e2e_s"]["mean"] >= result["ttft_s"]["mean"]
