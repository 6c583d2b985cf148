"""GrammarCache (compile once, off the caller's thread, with a timeout) and GrammarMatchers
(one matcher per request, following its tokens; the step's token bitmask)."""

import threading
import time

import pytest
import torch

from metrale.messages.sampling_params import SamplingParams
from metrale.messages.scheduler_output import PLACEHOLDER
from metrale.messages.structured_outputs import StructuredOutputsError, StructuredOutputsParams as Spec
from metrale.structured.grammars import GrammarCache, GrammarError
from metrale.structured.matchers import GrammarMatchers

pytest.importorskip("xgrammar")

HEAVY = Spec(json={"enum": [f"v{i}" for i in range(20000)]})  # ~0.8 s to compile here


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny byte-level BPE tokenizer of the test checkpoints (384 tokens)."""
    from checkpoints import make_tokenizer

    return make_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    cache = GrammarCache(tokenizer, len(tokenizer), timeout_s=5.0)
    cache.ready().result()
    yield cache
    cache.close()


def test_compiles_each_kind_once(grammars):
    specs = [Spec(json={"type": "object", "properties": {"a": {"type": "integer"}}}), Spec(json_object=True),
             Spec(regex=r"\d{3}-[a-z]+"), Spec(choice=["yes", 'no "way"', "ünï"]),
             Spec(grammar='root ::= "(" root ")" | "x"')]
    compiled = [grammars.compile(s) for s in specs]
    before = grammars.num_compiles
    assert [grammars.compile(s) for s in specs] == compiled  # the same objects, from the cache
    assert grammars.compile(Spec(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')) is compiled[0]
    assert grammars.num_compiles == before


@pytest.mark.parametrize("spec,match", [
    (Spec(regex="foo**"), "regex does not compile: .*repetition"),
    (Spec(regex="(ab"), "parenthesis is not closed"),
    (Spec(regex="[a-"), "regex does not compile"),
    (Spec(grammar='root ::= "a" | '), "EBNF grammar does not compile"),
    (Spec(grammar='start ::= "a"'), "root"),
    (Spec(grammar="root ::= a\na ::= root"), "accepts no output"),
    (Spec(json={"type": "foo"}), "JSON schema does not compile: Unsupported type"),
    (Spec(json={"type": "integer", "minimum": 5, "maximum": 1}), "Invalid range"),
    (Spec(json={"properties": {"a": {"$ref": "#/nowhere"}}}), "JSON schema does not compile"),
    (Spec(json={"properties": {"a": {"type": "string", "pattern": "foo**"}}}), "pattern 'foo\\*\\*' is not a regex"),
])
def test_invalid_specs_are_grammar_errors(grammars, spec, match):
    with pytest.raises(GrammarError, match=match) as e:
        grammars.compile(spec)
    assert "/project/" not in str(e.value) and e.value.param == "structured_outputs"
    assert spec.cache_key() not in grammars._entries  # failures are not kept
    grammars.compile(Spec(regex="ok"))  # and the cache still serves


def test_a_slow_compile_times_out_without_holding_the_caller(tokenizer):
    cache = GrammarCache(tokenizer, len(tokenizer), timeout_s=0.05)
    cache.ready().result()
    ticks = []
    stop = threading.Event()

    def tick():  # a thread that needs the GIL all along: xgrammar must release it while compiling
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.perf_counter()
    with pytest.raises(GrammarError, match="did not compile within 0.05 s"):
        cache.compile(HEAVY)
    assert time.perf_counter() - started < 0.5
    compiled = cache.submit(HEAVY).result(30)  # it went on, and is kept
    stop.set()
    ticker.join()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert max(gaps) < 0.25, f"a thread was held for {max(gaps):.2f} s during the compile"
    assert cache.compile(HEAVY) is compiled
    cache.close()


def test_no_tokenizer_means_no_structured_outputs():
    with pytest.raises(StructuredOutputsError, match="tokenizer"):
        GrammarCache(None, 100).compile(Spec(regex="a"))


def test_the_cache_is_bounded(tokenizer):
    cache = GrammarCache(tokenizer, len(tokenizer), max_entries=3)
    for i in range(6):
        cache.compile(Spec(regex=f"a{{{i + 1}}}"))
    assert len(cache) == 3 and cache.num_compiles == 6
    cache.close()


# -- matchers -------------------------------------------------------------------------------------


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def test_matchers_follow_tokens_and_end_at_stop(grammars, tokenizer):
    eos = tokenizer.eos_token_id
    vocab = len(tokenizer)
    matchers = GrammarMatchers(grammars)
    params = SamplingParams(structured_outputs=Spec(choice=["ab"]), eos_token_ids=[eos])
    matchers.add("r", params)
    prompt = [5, 6, 7]
    ids = tokenizer.encode("ab")
    tokens = list(prompt)
    for token in ids:
        mask = matchers.bitmask([("free", [1, 2], 2), ("r", tokens, len(prompt))])
        assert mask.rows == [1]
        allowed = _allowed(mask.bitmask[0], vocab)
        assert token in allowed and eos not in allowed
        tokens.append(token)
    mask = matchers.bitmask([("r", tokens, len(prompt))])
    assert _allowed(mask.bitmask[0], vocab) == {eos}  # complete: only the end
    tokens.append(eos)
    mask = matchers.bitmask([("r", tokens, len(prompt))])  # past the end (never sampled): stop again
    assert _allowed(mask.bitmask[0], vocab) == {eos}
    assert matchers.bitmask([("free", [1], 0)]) is None
    matchers.remove("r")
    assert len(matchers) == 0


def test_a_fresh_matcher_catches_up(grammars, tokenizer):
    """A request resumed after preemption (or seen first on another rank) arrives with outputs."""
    eos = tokenizer.eos_token_id
    matchers = GrammarMatchers(grammars)
    params = SamplingParams(structured_outputs=Spec(regex="(ab)+"), eos_token_ids=[eos])
    matchers.add("r", params)
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    mask = matchers.bitmask([("r", [9, a, b, a], 1)])
    assert _allowed(mask.bitmask[0], len(tokenizer)) == {b}
    with pytest.raises(RuntimeError, match="previous token is known"):
        matchers.bitmask([("r", [9, a, b, a, b, PLACEHOLDER], 1)])


def test_a_verify_steps_rows_are_masked_over_the_drafts_and_the_matcher_rolls_back(grammars, tokenizer):
    """Row j of a drafted request: the grammar's state after its outputs and its first j drafts.
    A draft the grammar refuses ends what is read: the rows after it repeat the row before it."""
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    spec = Spec(regex="(ab)+c")
    a, b, c = tokenizer.convert_tokens_to_ids(["a", "b", "c"])
    matchers, fresh = GrammarMatchers(grammars), GrammarMatchers(grammars)
    matchers.add("r", SamplingParams(structured_outputs=spec, eos_token_ids=[eos]))
    tokens = [9, 9, a]  # prompt [9, 9], output [a]
    drafts = [b, a, a, b]  # b and a follow the grammar, the second a does not
    mask = matchers.bitmask([("free", [1, 2], 2), ("r", tokens, 2)], [[3], drafts])
    assert mask.rows == [2, 3, 4, 5, 6]  # after the free request's two logits rows
    expected = []
    for j in range(3):  # rows 0..2: after drafts[:j], as a fresh matcher sees those outputs
        fresh.add(f"f{j}", SamplingParams(structured_outputs=spec, eos_token_ids=[eos]))
        expected.append(fresh.bitmask([(f"f{j}", tokens + drafts[:j], 2)]).bitmask[0])
    assert [_allowed(row, vocab) for row in expected] == [{b}, {a, c}, {b}]
    for j in range(3):
        assert torch.equal(mask.bitmask[j], expected[j])
    assert torch.equal(mask.bitmask[3], expected[2]) and torch.equal(mask.bitmask[4], expected[2])
    # The drafts were rolled back: the matcher holds the outputs only.
    assert _allowed(matchers.bitmask([("r", tokens, 2)]).bitmask[0], vocab) == {b}
    # A draft that ends the output: the rows past the stop allow only stops.
    mask = matchers.bitmask([("r", tokens + [b], 2)], [[c, eos, a]])
    assert [_allowed(row, vocab) for row in mask.bitmask] == [{a, c}, {eos}, {eos}, {eos}]
    with pytest.raises(RuntimeError, match="known on the host"):
        matchers.bitmask([("r", tokens, 2)], [[PLACEHOLDER]])


def test_batched_fill_matches_one_by_one(grammars, tokenizer):
    eos = tokenizer.eos_token_id
    spec = Spec(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    rows, tokens = [], tokenizer.encode('{"n": 1')
    single, batch = GrammarMatchers(grammars), GrammarMatchers(grammars)
    for i in range(10):
        for m in (single, batch):
            m.add(f"r{i}", SamplingParams(structured_outputs=spec, eos_token_ids=[eos]))
        rows.append((f"r{i}", [3] + tokens[:i % len(tokens)], 1))
    together = batch.bitmask(rows).bitmask
    alone = torch.cat([single.bitmask([row]).bitmask for row in rows])
    assert torch.equal(together, alone)


def test_json_strings_hold_no_control_characters_nor_special_tokens(grammars, tokenizer):
    import xgrammar as xgr

    # xgrammar's own length-bounded strings admit raw control characters; met gives them a pattern.
    for schema in ({"type": "string", "maxLength": 5}, {"type": "string", "minLength": 1}, {"type": "string"}):
        matcher = xgr.GrammarMatcher(grammars.compile(Spec(json=schema)))
        assert not matcher.accept_string('"a\x07')
    matchers = GrammarMatchers(grammars)
    matchers.add("r", SamplingParams(structured_outputs=Spec(json={"type": "string"}),
                                     eos_token_ids=[tokenizer.eos_token_id]))
    quote = tokenizer.convert_tokens_to_ids('"')
    allowed = _allowed(matchers.bitmask([("r", [quote], 0)]).bitmask[0], len(tokenizer))
    special = {tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert len(allowed) > 200 and not allowed & special
