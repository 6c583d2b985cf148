"""The OpenAI-compatible API through the official `openai` client, sync and async."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from conftest import wait_for

pytestmark = pytest.mark.slow

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, world!"}]
WORDS = ["fox", "dog", "cache", "block", "batch", "token", "world", "emoji", "text", "pass", "add", "lazy"]
PROMPTS = [f"The {WORDS[i % len(WORDS)]} {WORDS[(i * 5 + 3) % len(WORDS)]} number {i}:" for i in range(32)]


def sse_events(response: httpx.Response) -> list[str]:
    """The data fields of an SSE stream, in order."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: "):])
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def test_models(api_server, llama_checkpoint):
    models = api_server.client().models.list()
    assert [m.id for m in models.data] == [llama_checkpoint]
    assert "scheduling: asynchronous" in api_server.log()  # the engine these tests exercise


def test_chat_streamed_equals_non_streamed(api_server):
    client = api_server.client()
    full = client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT, max_tokens=24,
                                          temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=full.model, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_sse_wire_format(api_server):
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", api_server.url + "/v1/chat/completions", json=body, headers=api_server.headers,
                      timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completions_streamed_equals_non_streamed(api_server):
    client = api_server.client()
    model = client.models.list().data[0].id
    full = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=20, temperature=0)
    streamed = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=20, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
    assert full.usage.completion_tokens == 20 and full.choices[0].finish_reason == "length"


def test_completions_prompt_forms_and_echo(api_server):
    client = api_server.client()
    model = client.models.list().data[0].id
    ids = httpx.post(api_server.url + "/tokenize", json={"prompt": "Hello, world!"},
                     headers=api_server.headers).json()["tokens"]
    by_text = client.completions.create(model=model, prompt="Hello, world!", max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=model, prompt=[ids, ids[:3]], max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model=model, prompt=["Hello, world!", "Hi"], max_tokens=5, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "Hello, world!" + by_text.choices[0].text
    assert echoed.choices[1].text.startswith("Hi")
    streamed = client.completions.create(model=model, prompt=["Hello, world!", "Hi"], max_tokens=5, temperature=0,
                                         echo=True, stream=True)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: echoed.choices[0].text, 1: echoed.choices[1].text}


def test_n2_and_seed(api_server):
    client = api_server.client()
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=1.0, seed=7, n=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    again = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=1.0, seed=7, n=2)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=1.0, seed=7,
                                                n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == {c.index: c.message.content for c in out.choices}


def test_stop_strings(api_server):
    client = api_server.client()
    model = client.models.list().data[0].id
    text = client.completions.create(model=model, prompt="Hello", max_tokens=32, temperature=0).choices[0].text
    # A stop string of two printable ASCII characters from the middle of the greedy text.
    start = next(i for i in range(2, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isprintable())
    stop = text[start:start + 2]
    expected = text[:text.index(stop)]
    for stream in (False, True):
        out = client.completions.create(model=model, prompt="Hello", max_tokens=32, temperature=0, stop=[stop, "@@"],
                                        stream=stream)
        if stream:
            chunks = list(out)
            got = "".join(c.choices[0].text for c in chunks)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
            assert got == expected and reason == ["stop"]
        else:
            assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
            assert out.choices[0].model_extra["stop_reason"] == stop


def test_logprobs(api_server):
    client = api_server.client()
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the best one
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    plain = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)

    comp = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    streamed = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True)
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs
              for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_async_client_32_concurrent_match_offline(api_server, llama_checkpoint):
    from metrale import LLM, SamplingParams

    async def run():
        client = api_server.async_client()
        model = (await client.models.list()).data[0].id
        outs = await asyncio.gather(*(client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0)
                                      for p in PROMPTS))
        chat = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0)
        await client.close()
        return [o.choices[0].text for o in outs], chat

    served, chat = asyncio.run(run())
    assert chat.choices[0].message.content is not None
    llm = LLM(model=llama_checkpoint, dtype="float32", device="cpu")
    offline = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert served == [o.outputs[0].text for o in offline]


def test_tokenize_detokenize(api_server):
    client = httpx.Client(base_url=api_server.url, headers=api_server.headers, timeout=30)
    tokens = client.post("/tokenize", json={"prompt": "Hello, world!"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello, world!"}
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > tokens["count"]
    assert client.post("/detokenize", json={"tokens": [10**6]}).status_code == 400


def test_metrics_and_memory(api_server):
    api_server.client().completions.create(model=api_server.client().models.list().data[0].id, prompt="Hi",
                                           max_tokens=3, temperature=0)
    text = httpx.get(api_server.url + "/metrics", headers=api_server.headers).text
    for name in ("met:num_requests_running", "met:num_requests_waiting", "met:kv_cache_usage_perc",
                 "met:prompt_tokens_total", "met:generation_tokens_total", "met:num_preemptions_total",
                 "met:time_to_first_token_seconds_bucket", "met:inter_token_latency_seconds_bucket",
                 "met:e2e_request_latency_seconds_bucket", "met:prefix_cache_queries_total",
                 "met:prefix_cache_hits_total"):
        assert name in text, name
    values = api_server.metrics()
    assert values["met:generation_tokens_total"] >= 3 and values["met:prompt_tokens_total"] > 0
    memory = httpx.get(api_server.url + "/memory", headers=api_server.headers).json()
    device = memory["devices"][0]
    ledger = device["ledger"]
    for key in ("weights_bytes", "kv_cache_bytes", "activation_reserve_bytes", "cuda_graphs_bytes", "plan"):
        assert key in ledger, key
    assert ledger["plan"]["num_kv_blocks"] == device["kv_blocks_total"]
    for key in ("total_bytes", "free_bytes", "weights_bytes", "kv_cache_bytes", "activation_reserve_bytes",
                "kv_blocks_total", "kv_blocks_in_use"):
        assert isinstance(device[key], int) and device[key] >= 0, key
    assert device["weights_bytes"] > 0 and device["kv_blocks_total"] > 0 and device["kv_blocks_in_use"] == 0
    assert device["kv_cache_bytes"] == device["kv_blocks_total"] * device["kv_bytes_per_block"] == ledger["kv_cache_bytes"]
    assert device["state_slots_total"] == device["state_cache_bytes"] == ledger["state_cache_bytes"] == 0  # no state
    assert device["caches"] and device["caches"][0].startswith("attention: 2 layer(s)")


def _idle(server) -> bool:
    values = server.metrics()
    return values["met:num_requests_running"] == 0 and values["met:kv_cache_usage_perc"] == 0


def test_disconnects_abort_requests(api_server):
    """Reliability case 22: 64 streams (and n=4 ones) closed after their first chunk."""
    assert _idle(api_server)
    before = api_server.metrics()["met:generation_tokens_total"]

    async def open_and_drop(client: httpx.AsyncClient, n: int):
        body = {"messages": CHAT, "max_tokens": 400, "temperature": 1.0, "n": n, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"content":""' not in line:
                    return  # first content chunk: leave, closing the connection

    async def run():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=api_server.url, headers=api_server.headers, timeout=60,
                                     limits=limits) as client:
            await asyncio.gather(*(open_and_drop(client, 4 if i % 16 == 0 else 1) for i in range(64)))

    asyncio.run(run())
    closed = time.monotonic()
    assert wait_for(lambda: _idle(api_server), timeout=1.0), api_server.metrics()
    assert time.monotonic() - closed < 1.5
    assert api_server.metrics()["met:generation_tokens_total"] - before < 64 * 400 / 4  # aborted, not finished
    # The server still works.
    out = api_server.client().completions.create(model=api_server.client().models.list().data[0].id,
                                                 prompt="Hi", max_tokens=2)
    assert out.choices[0].finish_reason == "length"


def test_non_streamed_disconnect_aborts(api_server):
    assert _idle(api_server)
    before = api_server.metrics()["met:generation_tokens_total"]
    body = json.dumps({"prompt": "Hello", "max_tokens": 480, "n": 4, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_server.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", api_server.port)) as conn:
        conn.sendall(head + body)
        assert wait_for(lambda: api_server.metrics()["met:num_requests_running"] == 4, timeout=10)
    assert wait_for(lambda: _idle(api_server), timeout=1.0), api_server.metrics()
    generated = api_server.metrics()["met:generation_tokens_total"] - before
    assert generated < 4 * 480 / 2  # stopped early, not run to the end


def test_streamed_bytes_are_valid_utf8(api_server):
    """Case 9: a random model emits byte tokens that split characters; the wire stays valid UTF-8."""
    body = {"prompt": "Ünïcödé text, emoji 🙂 and CJK 漢字", "max_tokens": 64, "temperature": 1.0, "seed": 3,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", api_server.url + "/v1/completions", json=body, headers=api_server.headers,
                      timeout=60) as response:
        raw = response.read()
    text = raw.decode("utf-8")  # strict: raises on any broken sequence
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    full = httpx.post(api_server.url + "/v1/completions", json={**body, "stream": False},
                      headers=api_server.headers, timeout=60).json()
    assert streamed == full["choices"][0]["text"]


def test_return_token_ids(api_server):
    """vLLM's extension: choices carry the generated ids, streamed or not, equal to the offline ids."""
    http = httpx.Client(base_url=api_server.url, headers=api_server.headers, timeout=60)
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    full = http.post("/v1/completions", json=body).json()["choices"][0]
    assert len(full["token_ids"]) == 6
    streamed = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0].get("token_ids") or []
    assert streamed == full["token_ids"]
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                                   "return_token_ids": True}).json()
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]


def test_logit_bias_steers_the_reply(api_server):
    client = api_server.client()
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                    logit_bias={"42": 100}, extra_body={"return_token_ids": True,
                                                                        "ignore_eos": True})
    assert out.choices[0].token_ids == [42, 42, 42]
