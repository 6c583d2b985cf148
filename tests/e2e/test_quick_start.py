"""A quick, talkative start (issue 22): help at once with defaults, a first line at once, a line
per startup phase, the CPU thread choice logged, and an API key that never has to be on the
command line."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from conftest import ServerProcess

MET = [sys.executable, "-m", "metrale.entrypoints.cli"]


def _best_time(command: list[str], runs: int = 3) -> tuple[float, str]:
    best, out = float("inf"), ""
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
        best = min(best, time.perf_counter() - start)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
    return best, out


def test_help_answers_within_a_second_and_shows_defaults():
    seconds, _ = _best_time(MET + ["--help"])
    assert seconds < 1.0, f"met --help took {seconds:.2f}s"
    seconds, text = _best_time(MET + ["serve", "--help"])
    assert seconds < 1.0, f"met serve --help took {seconds:.2f}s"
    flat = " ".join(text.split())
    for shown in ("(default: 8000)", "(default: 127.0.0.1)", "(default: 0.9)", "8192 on CUDA, 512 on the CPU"):
        assert shown in flat, shown


def test_help_imports_no_torch():
    code = ("import sys; from metrale.entrypoints.cli import build_parser; build_parser(); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.split() == ["False", "False"]


def test_serve_speaks_at_once_then_logs_each_phase(llama_checkpoint, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-a-file\n")
    server = ServerProcess(llama_checkpoint, str(tmp_path / "serve.log"), "--api-key-file", str(key_file))
    started = time.monotonic()
    first_line_after = None
    try:
        while first_line_after is None and time.monotonic() - started < 30:
            if "met serve: starting" in server.log():
                first_line_after = time.monotonic() - started
            time.sleep(0.02)
        server.wait_ready()
        log = server.log()
        assert first_line_after is not None and first_line_after < 1.5, (first_line_after, log)
        for number, phase in enumerate(("imports", "model resolve", "configure", "backend", "topology", "weights",
                                        "kv cache", "kernel audit", "ready")):
            assert f"[{number}] {phase}" in log, phase
        assert "CPU threads: 1 (OMP_NUM_THREADS)" in log  # the e2e servers run with OMP_NUM_THREADS=1
        assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 401
        ok = httpx.get(server.url + "/v1/models", timeout=5, headers={"Authorization": "Bearer sk-from-a-file"})
        assert ok.status_code == 200
    finally:
        assert server.stop() == 0


def test_serve_takes_the_api_key_from_the_environment(llama_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("MET_API_KEY", "sk-from-env")
    server = ServerProcess(llama_checkpoint, str(tmp_path / "serve.log")).wait_ready()
    try:
        assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 401
        ok = httpx.get(server.url + "/v1/models", timeout=5, headers={"Authorization": "Bearer sk-from-env"})
        assert ok.status_code == 200
        assert "sk-from-env" not in " ".join(open(f"/proc/{server.proc.pid}/cmdline").read().split("\0"))
    finally:
        assert server.stop() == 0


def test_serve_port_0_picks_a_free_port(llama_checkpoint, tmp_path):
    proc = subprocess.Popen(MET + ["serve", "--model", llama_checkpoint, "--device", "cpu", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 90
        url = None
        for line in proc.stdout:
            if "serving" in line and "http://127.0.0.1:" in line:
                url = line.split("at ", 1)[1].split("/v1")[0]
                break
            assert time.monotonic() < deadline
        assert url is not None and not url.endswith(":0")
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


def test_memory_and_metrics_report_the_forward_and_the_host_footprint(api_server):
    memory = httpx.get(api_server.url + "/memory", headers=api_server.headers, timeout=5).json()
    assert memory["forward"] == "reference"  # the CPU's
    host = memory["host"]
    assert host["baseline_rss_bytes"] > 0 and host["rss_bytes"] >= host["baseline_rss_bytes"]
    assert host["footprint_bytes"] == host["rss_bytes"] - host["baseline_rss_bytes"]
    text = httpx.get(api_server.url + "/metrics", headers=api_server.headers, timeout=5).text
    assert 'met:engine_info{device="cpu",forward="reference",model_name=' in text


def test_profile_routes_write_a_trace_of_chosen_steps(llama_checkpoint, tmp_path):
    traces = tmp_path / "traces"
    server = ServerProcess(llama_checkpoint, str(tmp_path / "serve.log"), "--profile", str(traces)).wait_ready()
    try:
        url = server.url
        assert httpx.post(url + "/stop_profile", timeout=10).status_code == 409  # not running
        assert httpx.post(url + "/start_profile", timeout=10).json()["status"] == "started"
        assert httpx.post(url + "/start_profile", timeout=10).status_code == 409  # already running
        completion = httpx.post(url + "/v1/completions", timeout=30,
                                json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert completion.status_code == 200
        stopped = httpx.post(url + "/stop_profile", timeout=30).json()
        trace = stopped["trace"]
        assert os.path.dirname(trace) == str(traces) and os.path.getsize(trace) > 0
        assert "steps" in os.path.basename(trace)
        # num_steps: it stops by itself
        assert httpx.post(url + "/start_profile", json={"num_steps": 2}, timeout=10).status_code == 200
        httpx.post(url + "/v1/completions", timeout=30, json={"prompt": "hello", "max_tokens": 4})
        assert httpx.post(url + "/stop_profile", timeout=10).status_code == 409  # already stopped after 2 steps
        assert len(os.listdir(traces)) == 2
    finally:
        assert server.stop() == 0


def test_profile_routes_exist_only_with_the_flag(api_server):
    assert httpx.post(api_server.url + "/start_profile", headers=api_server.headers, timeout=5).status_code == 404
