"""Constrained generation on a tiny random model, offline: the outputs follow their grammars
over many seeds at temperature 1, end with "stop", leave free requests in the same batch
untouched, and come out the same under asynchronous scheduling, chunked prefill and
preemption (a draw depends only on the request's seed, its logits and its grammar)."""

import ast
import json
import re

import pytest

from metrale import LLM, SamplingParams
from metrale.messages.errors import InvalidRequestError
from metrale.messages.structured_outputs import StructuredOutputsParams as Spec
from metrale.structured.grammars import JSON_MAX_WHITESPACE

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
    },
    "required": ["name", "age", "tags", "ok", "code"],
    "additionalProperties": False,
}
REGEX = r"(cat|dog)-[0-9]{2,4}( [a-z]{1,5})?"
CHOICES = ["red", "green", "blue sky", 'say "hi"']
# Sums of small numbers in parentheses: Python expressions, so ast can check the outputs.
GRAMMAR = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= "0" | [1-9] [0-9]?
'''
SEEDS = range(6)
PROMPTS = ["Hello, world!", "The quick brown fox", "def add(a, b):"]


def _params(spec: Spec, seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=300, structured_outputs=spec, **kw)


def _batch():
    """(prompt, params) of every kind, several seeds each."""
    kinds = [Spec(json=SCHEMA), Spec(json_object=True, disable_any_whitespace=True), Spec(regex=REGEX),
             Spec(choice=CHOICES), Spec(grammar=GRAMMAR)]
    return [(PROMPTS[seed % len(PROMPTS)], _params(spec, seed)) for spec in kinds for seed in SEEDS]


def _check(spec: Spec, text: str) -> None:
    """`text` follows `spec`: its own schema, regex or choices; an EBNF grammar is GRAMMAR."""
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json)
        # The schema's strings hold no whitespace: every run of it lies between tokens.
        assert max(map(len, re.findall(r"\s+", text)), default=0) <= JSON_MAX_WHITESPACE, text
    elif spec.json_object:  # disable_any_whitespace: only the separators' single spaces, outside strings
        assert isinstance(json.loads(text), dict)
        assert not re.search(r"[\t\r\n]|  ", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)), text
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    else:
        assert spec.grammar == GRAMMAR
        tree = ast.parse(text, mode="eval")
        allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub)
        assert all(isinstance(node, allowed) for node in ast.walk(tree)), text


def _generate(llm, batch):
    outs = llm.generate([p for p, _ in batch], [params for _, params in batch], use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=512)


@pytest.fixture(scope="module")
def reference(llm):
    """Every kind over every seed, synchronous scheduling, room for all."""
    batch = _batch()
    return batch, _generate(llm, batch)


def test_outputs_follow_their_grammars(reference):
    batch, outputs = reference
    for (_, params), out in zip(batch, outputs):
        spec = params.structured_outputs
        if spec.json_object and out.finish_reason == "length":
            continue  # free-form JSON: a random model's keys and strings may run past max_tokens
        assert out.finish_reason == "stop", (spec.kind, out.text)
        _check(spec, out.text)
    objects = [out for (_, params), out in zip(batch, outputs) if params.structured_outputs.json_object]
    assert sum(out.finish_reason == "stop" for out in objects) >= 2
    by_kind = {}
    for (_, params), out in zip(batch, outputs):
        by_kind.setdefault(params.structured_outputs.kind, set()).add(out.text)
    assert all(len(texts) > 1 for texts in by_kind.values()), by_kind  # the seeds do draw


def test_free_requests_are_untouched_by_constrained_neighbours(llm):
    free = [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for p in PROMPTS]
    alone = _generate(llm, free)
    mixed = [free[0]] + _batch()[::7] + free[1:]
    outputs = _generate(llm, mixed)
    together = [outputs[0]] + outputs[-2:]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_same_outputs_with_async_scheduling_chunked_prefill_and_preemption(checkpoint, reference):
    batch, expected = reference
    # 16-token chunks; a pool too small for every request at once: some are preempted and recomputed.
    llm = LLM(checkpoint, dtype="float32", device="cpu", async_scheduling=True, max_num_batched_tokens=16,
              num_kv_blocks=24, block_size=16, max_model_len=512, enable_prefix_caching=False)
    assert llm.llm_engine.async_scheduling
    long_prompt = " ".join(PROMPTS * 4)  # several chunks
    mixed = batch + [(long_prompt, _params(Spec(json=SCHEMA), 99))]
    outputs = _generate(llm, mixed)
    assert [o.text for o in outputs[:-1]] == [o.text for o in expected]
    _check(Spec(json=SCHEMA), outputs[-1].text)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    # The runner hears of finished requests with the next plan: after one more, no matcher is left.
    _generate(llm, [("Hello", SamplingParams(max_tokens=1))])
    assert len(llm.llm_engine.runner.matchers) == 0


def test_n_completions_each_follow_the_grammar(llm):
    out = llm.generate("Hello", SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=300,
                                               structured_outputs=Spec(json=SCHEMA)), use_tqdm=False)[0]
    assert len({c.text for c in out.outputs}) > 1
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_max_tokens_first_is_length_and_aborts_free_matchers(llm):
    out = _generate(llm, [("Hello", SamplingParams(max_tokens=3, structured_outputs=Spec(json=SCHEMA)))])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    engine = llm.llm_engine
    engine.add_request("gone", "Hello", _params(Spec(regex="[a-z]{200}"), 1))
    for _ in range(3):
        engine.step()
    assert "gone" in engine.runner.matchers
    engine.abort_request("gone")
    engine.step()
    assert len(engine.runner.matchers) == 0 and not engine.has_unfinished_requests()


def test_invalid_grammar_is_refused_before_queueing(llm):
    with pytest.raises(InvalidRequestError, match="regex does not compile") as e:
        llm.generate("Hello", SamplingParams(structured_outputs=Spec(regex="foo**")), use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert not llm.llm_engine.has_unfinished_requests()
    assert _generate(llm, [("Hello", _params(Spec(choice=["ok"]), 0))])[0].text == "ok"


def test_two_ranks_compile_and_draw_what_one_rank_does(checkpoint, reference):
    """Every rank samples, so every rank holds matchers: the worker compiles each spec itself
    when the request reaches it. tp=2 with asynchronous scheduling draws one rank's tokens."""
    from parallel_cases import free_port

    batch, expected = reference
    subset = list(range(0, len(batch), 5))
    llm = LLM(checkpoint, dtype="float32", device="cpu", tp_size=2, master_port=free_port(), async_scheduling=True,
              num_kv_blocks=256, max_model_len=512)
    try:
        outputs = _generate(llm, [batch[i] for i in subset])
    finally:
        llm.close()
    assert [o.text for o in outputs] == [expected[i].text for i in subset]
