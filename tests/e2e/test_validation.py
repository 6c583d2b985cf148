"""Bad input gets its status and OpenAI's error object; a good request works right after.

Reliability cases 5-9, 13 and 14.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from conftest import API_KEY

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"

# (path, body, param named in the error); each must give 400.
BAD_REQUESTS = [
    # reliability case 5: prompt + max_tokens over the context
    (COMP, {"prompt": "Hello", "max_tokens": 600}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 10**5}, "max_tokens"),
    # case 6: out-of-range values and wrong types
    (COMP, {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    (COMP, {"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    (COMP, {"prompt": "Hi", "max_tokens": 2**63}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "temperature": -1}, "temperature"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, "top_p"),
    (CHAT, {"messages": MSG, "top_p": 0}, "top_p"),
    (CHAT, {"messages": MSG, "top_k": 0.5}, "top_k"),
    (CHAT, {"messages": MSG, "n": 0}, "n"),
    (CHAT, {"messages": MSG, "min_p": 2}, "min_p"),
    (CHAT, {"messages": MSG, "presence_penalty": 3}, "presence_penalty"),
    (CHAT, {"messages": MSG, "frequency_penalty": -2.5}, "frequency_penalty"),
    (CHAT, {"messages": MSG, "seed": 2**64}, "seed"),
    (CHAT, {"messages": MSG, "max_tokens": "5"}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 5.0}, "max_tokens"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": MSG, "stream": "yes"}, "stream"),
    (CHAT, {"messages": MSG, "n": True}, "n"),
    (CHAT, {"messages": "Hi"}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": MSG, "stop": 5}, "stop"),
    (COMP, {"prompt": 5}, "prompt"),
    (COMP, {"prompt": [1.5, 2]}, "prompt"),
    (COMP, {"prompt": [-1, 2]}, "prompt"),
    (COMP, {"prompt": [10**6]}, "prompt"),
    (COMP, {}, "prompt"),
    # case 7: caps checked before the engine
    (CHAT, {"messages": MSG, "n": 10**6}, "n"),
    (CHAT, {"messages": MSG, "n": 5}, "n"),  # --max-n 4
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (COMP, {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    (COMP, {"prompt": "Hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    (COMP, {"prompt": "Hi", "stop_token_ids": [10**6], "min_tokens": 2}, "stop_token_ids"),
    # case 8: logit_bias
    (CHAT, {"messages": MSG, "logit_bias": {"1000000": 1}}, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"-1": 1}}, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"1.0": 1}}, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"5": 1e9}}, "logit_bias"),
    # case 9: empty input
    (COMP, {"prompt": ""}, "prompt"),
    (COMP, {"prompt": []}, "prompt"),
    (COMP, {"prompt": [[]]}, "prompt"),
    (CHAT, {"messages": []}, "messages"),
    # features that are not there yet are refused, not ignored
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    (COMP, {"prompt": "Hi", "suffix": "end"}, "suffix"),
    (COMP, {"prompt": "Hi", "echo": True, "logprobs": 1}, "echo"),
]


@pytest.fixture(scope="module")
def http(api_server):
    with httpx.Client(base_url=api_server.url, headers=api_server.headers, timeout=60) as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_works(http: httpx.Client) -> None:
    response = http.post(COMP, json={"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS, ids=[f"{p}-{b}"[:90] for p, b, _ in BAD_REQUESTS])
def test_bad_request_is_400(http, path, body, param):
    assert_error(http.post(path, json=body), 400, param)
    if "stream" not in body:  # a streamed request is refused before the 200 goes out
        assert_error(http.post(path, json={**body, "stream": True}), 400, param)


def test_context_overflow_message(http):
    error = assert_error(http.post(COMP, json={"prompt": "Hello", "max_tokens": 600}), 400, "max_tokens")
    assert error["message"].startswith("This model's maximum context length is 512 tokens. However, you requested")
    assert_works(http)


@pytest.mark.parametrize("raw", [
    b'{"prompt": "\\ud800 lone surrogate"}',  # JSON escape of a lone surrogate
    b'{"prompt": "\xff\xfe not utf-8"}',
    b'{"prompt": "Hi", ',
    b'[1, 2]',
    b'',
    b'null',
])
def test_undecodable_bodies_are_400(http, raw):
    assert_error(http.post(COMP, content=raw, headers={"content-type": "application/json"}), 400)
    assert_works(http)


def test_chat_surrogate_is_400(http):
    raw = b'{"messages": [{"role": "user", "content": "\\udc80"}]}'
    assert_error(http.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400,
                 "messages[0].content")


def test_unknown_model_is_404(http):
    error = assert_error(http.post(CHAT, json={"model": "gpt-4", "messages": MSG}), 404, "model")
    assert error["code"] == "model_not_found"
    assert_error(http.get("/v1/nope"), 404)
    assert_works(http)


ROUTES = [("GET", "/v1/models"), ("POST", CHAT), ("POST", COMP), ("POST", "/tokenize"), ("POST", "/detokenize"),
          ("GET", "/metrics"), ("GET", "/memory"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/nowhere")]


@pytest.mark.parametrize("method,path", ROUTES)
@pytest.mark.parametrize("auth", [None, "Bearer sk-wrong", f"Bearer {API_KEY.lower()}", f"bearer {API_KEY}",
                                  API_KEY, f"Bearer {API_KEY}x"])
def test_api_key_on_every_route(api_server, method, path, auth):
    headers = {"Authorization": auth} if auth else {}
    response = httpx.request(method, api_server.url + path, headers=headers, json={"prompt": "Hi"})
    error = assert_error(response, 401)
    assert error["code"] == "invalid_api_key" and API_KEY not in response.text


def test_health_needs_no_key(api_server):
    assert httpx.get(api_server.url + "/health").status_code == 200


def test_body_over_limit_is_413(http):
    big = {"prompt": "a" * (17 << 20)}
    assert_error(http.post(COMP, json=big), 413)

    def chunked():
        for _ in range(20):
            yield b"a" * (1 << 20)

    assert_error(http.post(COMP, content=chunked(), headers={"content-type": "application/json"}), 413)
    assert_works(http)


def _raw_request(port: int, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(head)
        except OSError:  # the server may close while we still send
            pass
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
    return data


@pytest.mark.parametrize("headers", [
    b"X-Big: " + b"a" * (1 << 20) + b"\r\n",
    b"X-Big: " + b"a" * 40_000 + b"\r\n",
    b"".join(b"X-%d: y\r\n" % i for i in range(10_000)),
])
def test_oversized_headers_are_431(api_server, headers):
    reply = _raw_request(api_server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert b'"error"' in reply
    assert httpx.get(api_server.url + "/health").status_code == 200


def test_server_survived(http):
    assert_works(http)
    assert http.get("/health").status_code == 200
