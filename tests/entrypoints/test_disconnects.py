"""Abort latency through a real `met serve` (issue 22): clients that go away, streamed (n = 1 and
n = 4) or not, leave no running request and no KV block in use a second later.

The server runs the built-in demo model on the CPU with its defaults on loopback, so these
timings cover what a user of `met serve` gets: the step budget on the CPU (a step runs to its
end before an abort lands), the engine thread, the event loop and /metrics.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from server_process import ServerProcess

IDLE_WITHIN_SECONDS = 1.0
QUESTION = "What is the assert statement? "


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(None, str(tmp_path_factory.mktemp("abort") / "serve.log"), one_thread=False)
    try:
        s.wait_ready()
        yield s
    finally:
        code = s.stop()
    assert code == 0, s.log()


def _is_idle(server: ServerProcess) -> bool:
    m = server.metrics()
    return (m["met:num_requests_running"] == 0 and m["met:num_requests_waiting"] == 0
            and m["met:kv_cache_usage_perc"] == 0)


def _seconds_until_idle(server: ServerProcess, since: float, limit: float = 10.0) -> float:
    while not _is_idle(server):
        if time.monotonic() - since > limit:
            raise AssertionError(f"still busy {limit}s after the clients left: {server.metrics()}")
        time.sleep(0.02)
    return time.monotonic() - since


def _assert_nothing_held(server: ServerProcess) -> None:
    device = httpx.get(server.url + "/memory", timeout=5).json()["devices"][0]
    assert device["kv_blocks_in_use"] == 0, device


def test_64_streams_closed_after_their_first_chunk_free_everything_within_a_second(server):
    """Chat streams, every 16th with n = 4, long max_tokens and prompts of a couple of hundred
    tokens, closed after their first chunk (the role, sent once the engine took the request):
    the aborts land while the engine prefills the others."""
    assert _is_idle(server)
    prompt = QUESTION * 30  # about 200 tokens of the demo model's tokenizer

    async def open_and_drop(client: httpx.AsyncClient, i: int) -> float:
        body = {"messages": [{"role": "user", "content": f"{i} {prompt}"}], "max_tokens": 1800,
                "temperature": 1.0, "n": 4 if i % 16 == 0 else 1, "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # leaving the block closes the connection mid-stream
        return time.monotonic()

    async def run() -> float:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=100)) as c:
            return max(await asyncio.gather(*(open_and_drop(c, i) for i in range(64))))

    last_close = asyncio.run(run())
    waited = _seconds_until_idle(server, last_close)
    assert waited < IDLE_WITHIN_SECONDS, f"idle {waited:.2f}s after the last client left"
    _assert_nothing_held(server)


def test_a_non_streamed_request_whose_client_goes_away_frees_everything_within_a_second(server):
    assert _is_idle(server)
    body = ('{"prompt": "%s", "max_tokens": 1800, "n": 4, "ignore_eos": true}' % (QUESTION * 30)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(head + body)
        deadline = time.monotonic() + 20
        while server.metrics()["met:num_requests_running"] < 4:
            assert time.monotonic() < deadline, server.metrics()
            time.sleep(0.02)
    left = time.monotonic()
    waited = _seconds_until_idle(server, left)
    assert waited < IDLE_WITHIN_SECONDS, f"idle {waited:.2f}s after the client left"
    _assert_nothing_held(server)
