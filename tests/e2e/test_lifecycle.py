"""Loading, overload, SIGTERM drain and engine death (reliability cases 21, 24, 25)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from conftest import HERE, ServerProcess, wait_for

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def start(llama_checkpoint, tmp_path):
    servers = []

    def start_server(*extra: str, script: str | None = None) -> ServerProcess:
        server = ServerProcess(llama_checkpoint, str(tmp_path / f"serve{len(servers)}.log"), *extra, script=script)
        servers.append(server)
        return server.wait_ready()

    yield start_server
    for server in servers:
        server.stop(timeout=10)


def test_overload_gets_503_fast_and_admitted_finish(start):
    """Case 21: with 2 running + 2 waiting allowed, 16 at once: 4 finish, 12 get 503 + Retry-After."""
    server = start("--max-num-seqs", "2", "--max-waiting", "2")
    assert 503 in server.health_seen  # /health said 503 while the model loaded

    async def one(client: httpx.AsyncClient):
        sent = time.monotonic()
        response = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 200,
                                                              "ignore_eos": True})
        return response, time.monotonic() - sent

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=32)) as client:
            return await asyncio.gather(*(one(client) for _ in range(16)))

    results = asyncio.run(run())
    ok = [r for r, _ in results if r.status_code == 200]
    rejected = [(r, seconds) for r, seconds in results if r.status_code == 503]
    assert len(ok) == 4 and len(rejected) == 12, [r.status_code for r, _ in results]
    assert all(r.json()["usage"]["completion_tokens"] == 200 for r in ok)
    for response, seconds in rejected:
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "overloaded"
        assert seconds < 1.0, seconds
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert server.metrics()["met:request_rejected_total"] == 12


def _stream_chat(url: str, max_tokens: int, first_chunk: threading.Event, result: dict) -> None:
    body = {"messages": MSG, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        result["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first_chunk.set()
    result["events"] = events


def _start_streams(server: ServerProcess, count: int, max_tokens: int):
    started = [threading.Event() for _ in range(count)]
    results = [{} for _ in range(count)]
    threads = [threading.Thread(target=_stream_chat, args=(server.url, max_tokens, started[i], results[i]))
               for i in range(count)]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in started)
    return threads, results


def test_sigterm_drains_in_flight_requests(start):
    """Case 25: new requests get 503, the 6 streams in flight finish, the process exits 0."""
    server = start("--shutdown-timeout", "30")
    threads, results = _start_streams(server, 6, max_tokens=300)
    server.proc.send_signal(signal.SIGTERM)
    assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 503, timeout=2)
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    for t in threads:
        t.join(60)
    for result in results:
        assert result["status"] == 200 and result["events"][-1] == "[DONE]"
        chunks = [json.loads(e) for e in result["events"][:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all("error" not in c for c in chunks)
    assert server.proc.wait(30) == 0


def test_sigterm_past_the_timeout_aborts_with_an_error_event(start):
    server = start("--shutdown-timeout", "0")
    threads, results = _start_streams(server, 4, max_tokens=450)
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    for result in results:
        assert result["events"][-1] == "[DONE]"
        assert json.loads(result["events"][-2])["error"]["code"] == "shutting_down"
    assert server.proc.wait(15) == 0
    assert time.monotonic() - sent < 10


def test_engine_death_fails_requests_and_exits_nonzero(start):
    """Case 24: the engine loop raises; the request gets 503, /health 503, the process exits 1."""
    server = start(script=os.path.join(HERE, "crash_server.py"))
    healthy = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert healthy.status_code == 200
    died = time.monotonic()
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "CRASH_ENGINE", "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"

    def health():
        try:
            return httpx.get(server.url + "/health", timeout=1).status_code
        except httpx.HTTPError:
            return "gone"

    assert health() in (503, "gone")
    assert server.proc.wait(5) == 1
    assert time.monotonic() - died < 5
    assert "injected engine failure" in server.log()


def test_a_stalled_step_turns_health_503_until_it_ends(start):
    """Case 24: one step hangs; /health reports it within the stall timeout, then recovers."""
    server = start("--stall-timeout", "1", script=os.path.join(HERE, "stall_server.py"))
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    done = []
    thread = threading.Thread(target=lambda: done.append(httpx.post(
        server.url + "/v1/completions", json={"prompt": "STALL_ENGINE", "max_tokens": 2}, timeout=30)))
    thread.start()
    assert wait_for(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 503, timeout=3.5)
    stalled = httpx.get(server.url + "/health", timeout=5).json()
    assert stalled["error"]["code"] == "engine_stalled"
    thread.join(30)
    assert done and done[0].status_code == 200
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
