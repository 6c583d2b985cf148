"""A real `met serve` subprocess on 127.0.0.1, for the tests that drive one over HTTP (tests/e2e,
tests/entrypoints/test_disconnects.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """met:* samples of a /metrics page without labels other than model_name, by name."""
    values = {}
    for line in text.splitlines():
        if line.startswith("met:") and "{" in line:
            name, _, rest = line.partition("{")
            labels, _, value = rest.rpartition("} ")
            if labels.count("=") == 1:
                values[name] = float(value)
    return values


class ServerProcess:
    def __init__(self, checkpoint: str | None, log_path: str, *extra: str, api_key: str | None = None,
                 script: str | None = None, one_thread: bool = True):
        """`checkpoint` None: the built-in demo model with the server's own dtype and threads
        (`one_thread` False), as a user runs it."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        self.health_seen: list[int] = []  # /health statuses wait_ready saw, in order
        entry = [script] if script else ["-m", "metrale.entrypoints.cli"]
        model = ["--model", checkpoint, "--dtype", "float32"] if checkpoint is not None else []
        cmd = [sys.executable, *entry, "serve", *model, "--device", "cpu", "--port", str(self.port), *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        # One torch thread: the tiny model gains nothing from more, and spinning OpenMP threads on
        # a shared 2-core machine make step times erratic.
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        if one_thread:
            env["OMP_NUM_THREADS"] = "1"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 90.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"met serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status = httpx.get(self.url + "/health", timeout=1.0).status_code
            except httpx.HTTPError:
                status = None
            if status is not None:
                self.health_seen.append(status)
            if status == 200:
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"met serve did not become ready in {timeout}s:\n{self.log()}")

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                                  **kwargs)

    def metrics(self) -> dict[str, float]:
        """met:* samples without labels other than model_name, by name."""
        return parse_metrics(httpx.get(self.url + "/metrics", headers=self.headers, timeout=5).text)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
