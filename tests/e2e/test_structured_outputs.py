"""Structured outputs through the official `openai` client against `met serve` (the shared
server: asynchronous scheduling): every request format in chat and completions, streamed and
not, outputs that follow their grammars and end with "stop"; bad specs are 400s naming their
field with the server healthy after (reliability case 10); a compile past the timeout is a 400
while other requests keep flowing."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from conftest import ServerProcess

pytestmark = pytest.mark.slow
jsonschema = pytest.importorskip("jsonschema")

MSG = [{"role": "user", "content": "Hello, world!"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 30},
                   "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["city", "days", "code"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-z] | [0-9]'
GRAMMAR_RE = r"\((?:[a-z0-9])(?:,[a-z0-9])*\)"


@pytest.fixture(scope="module")
def client(api_server):
    return api_server.client()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _chat(client, model, stream=False, **kw):
    kw = {"temperature": 1.0, "max_tokens": 200, **kw}
    if not stream:
        choice = client.chat.completions.create(model=model, messages=MSG, **kw).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = list(client.chat.completions.create(model=model, messages=MSG, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]


def _completion(client, model, stream=False, **kw):
    kw = {"temperature": 1.0, "max_tokens": 200, **kw}
    if "response_format" in kw:  # not a completions field of the client's: vLLM's extension
        kw["extra_body"] = {**kw.get("extra_body", {}), "response_format": kw.pop("response_format")}
    if not stream:
        choice = client.completions.create(model=model, prompt="The quick brown fox", **kw).choices[0]
        return choice.text, choice.finish_reason
    chunks = list(client.completions.create(model=model, prompt="The quick brown fox", stream=True, **kw))
    return "".join(c.choices[0].text for c in chunks), [c.choices[0].finish_reason for c in chunks
                                                        if c.choices[0].finish_reason][-1]


def _json_schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}}


# (request fields, check of the text); each runs in chat and completions, streamed and not.
CASES = {
    "response_format json_schema": ({"response_format": _json_schema_format(SCHEMA)},
                                    lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "structured_outputs json": ({"extra_body": {"structured_outputs": {"json": SCHEMA}}},
                                lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "guided_json": ({"extra_body": {"guided_json": json.dumps(SCHEMA)}},
                    lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "structured_outputs regex": ({"extra_body": {"structured_outputs": {"regex": REGEX}}},
                                 lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    "guided_regex": ({"extra_body": {"guided_regex": REGEX}}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    "structured_outputs choice": ({"extra_body": {"structured_outputs": {"choice": CHOICES}}},
                                  lambda t: t in CHOICES or pytest.fail(t)),
    "guided_choice": ({"extra_body": {"guided_choice": CHOICES}}, lambda t: t in CHOICES or pytest.fail(t)),
    "structured_outputs grammar": ({"extra_body": {"structured_outputs": {"grammar": GRAMMAR}}},
                                   lambda t: re.fullmatch(GRAMMAR_RE, t) or pytest.fail(t)),
    "guided_grammar": ({"extra_body": {"guided_grammar": GRAMMAR}},
                       lambda t: re.fullmatch(GRAMMAR_RE, t) or pytest.fail(t)),
}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("case", list(CASES))
def test_formats_streamed_and_not(client, model, endpoint, case):
    fields, check = CASES[case]
    call = _chat if endpoint == "chat" else _completion
    for seed, stream in ((1, False), (2, True)):
        text, finish = call(client, model, stream=stream, seed=seed, **fields)
        assert finish == "stop", (case, text)
        check(text)
    # streamed deltas add up to the non-streamed text
    assert call(client, model, stream=True, seed=3, **fields) == call(client, model, seed=3, **fields)


def test_json_object_and_many_seeds(client, model):
    texts = set()
    for seed in range(8):
        text, finish = _chat(client, model, seed=seed, response_format=_json_schema_format(SCHEMA))
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > 1
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    for seed in range(3):  # free-form JSON: a random model's strings may run to max_tokens
        text, finish = _chat(client, model, seed=seed, response_format={"type": "json_object"}, max_tokens=40)
        assert isinstance(json.loads(text), dict) if finish == "stop" else text.startswith("{")
    text, _ = _chat(client, model, seed=0, extra_body={"structured_outputs": {"json": small,
                                                                              "disable_any_whitespace": True}})
    assert text in ('{"ok": true}', '{"ok": false}')


def test_mixed_batch_keeps_free_outputs(api_server, model):
    """Concurrent constrained and free requests: the free ones get the tokens they get alone."""
    client = api_server.async_client()

    async def free(i):
        reply = await client.completions.create(model=model, prompt=f"Number {i}:", max_tokens=12, temperature=0)
        return reply.choices[0].text

    async def constrained(i):
        reply = await client.chat.completions.create(model=model, messages=MSG, max_tokens=200, seed=i,
                                                     response_format=_json_schema_format(SCHEMA))
        return reply.choices[0]

    async def run():
        alone = [await free(i) for i in range(4)]
        results = await asyncio.gather(*(free(i) for i in range(4)), *(constrained(i) for i in range(6)))
        return alone, results

    alone, results = asyncio.run(run())
    assert list(results[:4]) == alone
    for choice in results[4:]:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


BAD = [
    ({"guided_regex": "foo**"}, "guided_regex", "regex does not compile"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "parenthesis"),
    ({"guided_regex": "[a-"}, "guided_regex", "regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar", "EBNF"),
    ({"guided_grammar": "root ::= a\na ::= root"}, "guided_grammar", "accepts no output"),
    ({"response_format": _json_schema_format({"type": "foo"})}, "response_format", "Unsupported type"),
    ({"response_format": _json_schema_format({"properties": {"a": {"$ref": "#/nowhere"}}})}, "response_format",
     "JSON schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"enum": ["x" * 300_000]}}, "guided_json", "bytes; at most"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_choice": "yes"}, "guided_choice", None),
    ({"structured_outputs": {"json": {"type": "string"}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured-output field"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "grammar decides"),
]


@pytest.mark.parametrize("body,param,words", BAD, ids=[p for _, p, _ in BAD])
def test_bad_specs_are_400_naming_the_field(api_server, body, param, words):
    with httpx.Client(base_url=api_server.url, headers=api_server.headers, timeout=30) as http:
        for path, base in (("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "Hi"})):
            for stream in (False, True):
                response = http.post(path, json={**base, "max_tokens": 4, "stream": stream, **body})
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == param and "/project/" not in error["message"], error
                if words:
                    assert words in error["message"], error
        assert http.get("/health").status_code == 200
        good = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "guided_choice": ["ok"]})
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == "ok"


@pytest.fixture(scope="module")
def slow_compile_server(llama_checkpoint, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("serve") / "structured_timeout.log")
    server = ServerProcess(llama_checkpoint, log, "--structured-outputs-timeout", "0.05").wait_ready()
    yield server
    assert server.stop() == 0, server.log()


def test_compile_past_the_timeout_is_400_while_others_flow(slow_compile_server):
    server = slow_compile_server
    heavy = {"enum": [f"v{i}" for i in range(20000)]}  # ~0.8 s to compile here

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "guided_regex": "a"})  # warm

            async def small():
                started = time.perf_counter()
                reply = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert reply.status_code == 200
                return time.perf_counter() - started

            async def health():
                started = time.perf_counter()
                assert (await http.get("/health")).status_code == 200
                return time.perf_counter() - started

            baseline = max([await small() for _ in range(3)])
            slow = asyncio.create_task(http.post("/v1/chat/completions", json={
                "messages": MSG, "max_tokens": 4, "response_format": _json_schema_format(heavy)}))
            await asyncio.sleep(0.01)
            during = [await asyncio.gather(small(), health()) for _ in range(5)]
            return baseline, await slow, during

    baseline, slow, during = asyncio.run(run())
    assert slow.status_code == 400, slow.text
    error = slow.json()["error"]
    assert error["param"] == "response_format" and "did not compile within 0.05 s" in error["message"]
    worst = max(max(pair) for pair in during)
    assert worst < max(0.5, 5 * baseline), (baseline, during)
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """The built-in demo model, a trained model whose free text is English about Python, drafting
    with its trained MTP layer (`--speculative`): constrained requests are drafted too, each
    verify row masked by the grammar's state after the drafts before it."""
    server = ServerProcess(None, str(tmp_path_factory.mktemp("demo") / "serve.log"), "--speculative").wait_ready()
    yield server
    assert server.stop() == 0, server.log()


def test_demo_model_answers_in_the_schema_and_calls_a_required_tool(demo_server):
    client = demo_server.client()
    schema = {"type": "object", "properties": {"statement": {"type": "string", "maxLength": 60},
                                               "keyword": {"enum": ["assert", "pass", "yield"]}},
              "required": ["statement", "keyword"], "additionalProperties": False}
    messages = [{"role": "user", "content": "What is the assert statement?"}]
    for seed in range(4):
        choice = client.chat.completions.create(
            model="demo", messages=messages, temperature=0.8, seed=seed, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                     "strict": True}}).choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    tool = {"type": "function", "function": {"name": "lookup", "description": "Look up a Python keyword",
                                             "parameters": {"type": "object", "required": ["keyword"],
                                                            "properties": {"keyword": {"type": "string",
                                                                                       "maxLength": 20}}}}}
    choice = client.chat.completions.create(model="demo", messages=messages, tools=[tool], max_tokens=80,
                                            tool_choice={"type": "function", "function": {"name": "lookup"}},
                                            temperature=0).choices[0]
    call = choice.message.tool_calls[0]
    assert call.function.name == "lookup"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    # Every request above was constrained, and MTP drafts for them were accepted.
    metrics = httpx.get(demo_server.url + "/metrics").text
    accepted = re.search(r"^met:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert accepted and float(accepted.group(1)) > 0, metrics[-2000:]
