"""The e2e tests' fixtures: a real `met serve` subprocess (tests/server_process.py) on 127.0.0.1
with a tiny checkpoint."""

from __future__ import annotations

import os
import time

import pytest

from server_process import ServerProcess, free_port, parse_metrics  # noqa: F401  (the e2e tests import them from here)

API_KEY = "sk-met-Test-Key"
HERE = os.path.dirname(__file__)


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
