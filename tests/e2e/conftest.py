"""A real `met serve` subprocess on 127.0.0.1 with a tiny checkpoint, for the e2e tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

API_KEY = "sk-met-Test-Key"
HERE = os.path.dirname(__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, checkpoint: str, log_path: str, *extra: str, api_key: str | None = None,
                 script: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        self.health_seen: list[int] = []  # /health statuses wait_ready saw, in order
        entry = [script] if script else ["-m", "metrale.entrypoints.cli"]
        cmd = [sys.executable, *entry, "serve", "--model", checkpoint, "--dtype", "float32", "--device", "cpu",
               "--port", str(self.port), *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        # One torch thread: the tiny model gains nothing from more, and spinning OpenMP threads on
        # a shared 2-core machine make step times erratic.
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
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
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=5).text
        values = {}
        for line in text.splitlines():
            if line.startswith("met:") and "{" in line:
                name, _, rest = line.partition("{")
                labels, _, value = rest.rpartition("} ")
                if labels.count("=") == 1:
                    values[name] = float(value)
        return values

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


@pytest.fixture(scope="session")
def llama_checkpoint(checkpoint_factory) -> str:
    return checkpoint_factory("llama")


@pytest.fixture(scope="session")
def api_server(llama_checkpoint, tmp_path_factory):
    """The shared server of the API and validation tests: an API key, --max-n 4, and asynchronous
    scheduling (the default on CUDA; off by default on the CPU), so that the API runs over the
    engine GPU users get."""
    log = str(tmp_path_factory.mktemp("serve") / "api_server.log")
    server = ServerProcess(llama_checkpoint, log, "--max-n", "4", "--async-scheduling", api_key=API_KEY).wait_ready()
    yield server
    code = server.stop()
    assert code == 0, server.log()


def wait_for(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
