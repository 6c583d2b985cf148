"""GrammarCache: the compiled grammars of one tokenizer, keyed by the spec.

A spec (StructuredOutputsParams) compiles on one of a few worker threads (xgrammar releases the
GIL while it compiles, so the event loop and the engine thread keep running), once: the cache
holds each key's future, so concurrent requests with the same grammar share one compile and
later ones find it done. Callers wait with a timeout; a compile that outlives it still finishes
(a thread cannot be stopped) and is kept, but the request that waited gets a 400.

A compile is also checked: a matcher is built and asked for its first token mask, so a grammar
that only fails when matched (xgrammar parses some pieces lazily), or one that accepts no output
at all, is a GrammarError here rather than a surprise in the engine loop.

Every rank of a multi-rank engine holds its own cache and compiles the specs of the requests it
runs: compiling is deterministic, and every rank samples (distributed/step_channel.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import re
import threading

from metrale.messages.structured_outputs import KIND_NAMES, StructuredOutputsError, StructuredOutputsParams

logger = logging.getLogger(__name__)

# Whitespace characters a JSON grammar allows in each gap between tokens (after a comma, around
# a colon, ...): enough for pretty-printed JSON a few levels deep, few enough that a model that
# keeps choosing spaces (a small one does) must move on. disable_any_whitespace: none at all.
JSON_MAX_WHITESPACE = 4
DEFAULT_TIMEOUT_S = 10.0
MAX_ENTRIES = 512
MAX_CACHE_BYTES = 1 << 30
MAX_PATTERN_LENGTH = 256  # _length_bounded_strings
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(StructuredOutputsError):
    """The spec does not compile (or not in time); a 400 naming the request field."""


def _message(error: BaseException) -> str:
    """xgrammar's message without its C++ location prefix."""
    text = str(error).strip() or type(error).__name__
    return _CPP_PREFIX.sub("", text).strip()


def _schema_patterns(schema) -> list[str]:
    """Every regex a JSON schema holds ("pattern" values, patternProperties keys)."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    found.append(value)
                elif key == "patternProperties" and isinstance(value, dict):
                    found.extend(k for k in value if isinstance(k, str))
                stack.append(value)
    return found


def _tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's view of the vocabulary, with every special token (control tokens such as
    <|im_start|>, whether or not the tokenizer names them among its special tokens) as an empty
    string: a grammar never allows those, only the stop tokens, where it may end."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return info
    special = set(tokenizer.all_special_ids)
    special.update(i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False))
    vocab = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in special:
            vocab[index] = token
    return xgr.TokenizerInfo(vocab, info.vocab_type, vocab_size=vocab_size, stop_token_ids=info.stop_token_ids,
                             add_prefix_space=info.add_prefix_space)


def _length_bounded_strings(schema: dict) -> dict:
    """The schema with each length-bounded string (minLength/maxLength up to
    MAX_PATTERN_LENGTH, no pattern or format) given the equivalent pattern `^.{min,max}$`.
    xgrammar 0.2.9 compiles a length-bounded string to characters that include raw control
    characters (a tab, U+0007), which no JSON parser takes; its pattern strings exclude them
    (and escapes: such a string holds no quote, backslash or control character). Longer bounds
    keep xgrammar's own form: its patterns grow slow to compile past a few hundred."""
    schema = json.loads(json.dumps(schema))  # a copy to edit
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        stack.extend(node.values())
        bounded = "minLength" in node or "maxLength" in node
        plain = not any(key in node for key in ("pattern", "format", "enum", "const"))
        if node.get("type") == "string" and bounded and plain:
            low, high = node.get("minLength", 0), node.get("maxLength")
            if (isinstance(low, int) and 0 <= low <= MAX_PATTERN_LENGTH
                    and (high is None or isinstance(high, int) and low <= high <= MAX_PATTERN_LENGTH)):
                node["pattern"] = f"^.{{{low},{'' if high is None else high}}}$"
                node.pop("minLength", None)  # the pattern holds them (and xgrammar warns of both)
                node.pop("maxLength", None)
    return schema


class GrammarCache:
    def __init__(self, tokenizer, vocab_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 2,
                 max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_CACHE_BYTES):
        """`vocab_size`: the width of the logits the sampler masks (the bitmask's width)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._threads = threads
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
        self._sizes: dict[tuple, int] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ready: concurrent.futures.Future | None = None
        self._compiler = None  # xgrammar.GrammarCompiler, built on a worker thread
        self.num_compiles = 0

    # -- the callers' side --------------------------------------------------------------------

    def ready(self) -> concurrent.futures.Future:
        """Resolves once xgrammar is imported and the tokenizer's vocabulary read (the first
        time: about a second for a 150K vocabulary); not counted against any compile's timeout."""
        if self.tokenizer is None:
            raise StructuredOutputsError("structured outputs need the tokenizer, and this engine runs without one "
                                         "(skip_tokenizer_init)")
        with self._lock:
            if self._ready is None:
                self._ready = self._executor().submit(self._build_compiler)
            return self._ready

    def submit(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """The future of spec's compiled grammar (xgrammar.CompiledGrammar): cached, in flight, or
        queued now. Its exception is a GrammarError."""
        key = spec.cache_key()
        self.ready()
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                return future
            future = self._executor().submit(self._compile, spec)
            self._entries[key] = future
            self._evict(key)
        future.add_done_callback(lambda done: self._settled(key, done))
        return future

    def compile(self, spec: StructuredOutputsParams, timeout_s: float | None = None):
        """Block until spec's grammar is compiled: the grammar, or GrammarError (invalid, or not
        compiled within the timeout, the cache's by default)."""
        self.ready().result()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return self.submit(spec).result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise self.timeout_error(spec, timeout_s) from None

    def timeout_error(self, spec: StructuredOutputsParams, timeout_s: float) -> GrammarError:
        return GrammarError(f"the {KIND_NAMES[spec.kind]} did not compile within {timeout_s:g} s "
                            f"(--structured-outputs-timeout); simplify it")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the worker threads --------------------------------------------------------------------

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="met-grammar")
        return self._pool

    def _build_compiler(self) -> None:
        try:
            import xgrammar as xgr

            info = _tokenizer_info(self.tokenizer, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self._threads, cache_enabled=False)
        except Exception as e:  # noqa: BLE001 - xgrammar missing, or it cannot read the tokenizer
            logger.error("structured outputs are unavailable: %s", e)
            raise GrammarError(f"the grammar engine could not start: {_message(e)}") from None

    def _compile(self, spec: StructuredOutputsParams):
        import xgrammar as xgr

        kind = spec.kind
        try:
            self.ready().result()
            if kind in ("json", "json_object"):
                schema = spec.schema()
                for pattern in _schema_patterns(schema):
                    try:
                        xgr.Grammar.from_regex(pattern)
                    except Exception as e:  # noqa: BLE001 - any refusal is the request's fault
                        raise GrammarError(f"the JSON schema's pattern {pattern[:80]!r} is not a regex xgrammar "
                                           f"takes: {_message(e)}") from None
                whitespace = {"any_whitespace": False} if spec.disable_any_whitespace else \
                    {"any_whitespace": True, "max_whitespace_cnt": JSON_MAX_WHITESPACE}
                compiled = self._compiler.compile_json_schema(json.dumps(_length_bounded_strings(schema)),
                                                              strict_mode=True, **whitespace)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(spec.regex)
            elif kind == "choice":
                # JSON string literals are EBNF string literals in xgrammar's dialect.
                compiled = self._compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
            else:
                compiled = self._compiler.compile_grammar(spec.grammar)
            self._check_matches(compiled)
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, its own types
            raise GrammarError(f"the {KIND_NAMES[kind]} does not compile: {_message(e)}") from None
        self.num_compiles += 1
        return compiled

    def _check_matches(self, compiled) -> None:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise GrammarError("the grammar accepts no output (is a rule defined only by itself?)")

    def _settled(self, key: tuple, future: concurrent.futures.Future) -> None:
        """Keep a compiled grammar (within the cache's bounds); forget a failed or cancelled one."""
        with self._lock:
            if future.cancelled() or future.exception() is not None:
                if self._entries.get(key) is future:
                    del self._entries[key]
                return
            if self._entries.get(key) is not future:
                return
            self._sizes[key] = int(future.result().memory_size_bytes)
            self._evict(key)

    def _evict(self, keep: tuple) -> None:
        """Drop the least recently used compiled grammars (never `keep`, nor one in flight) while
        the cache is over its bounds. Running requests keep theirs through their matchers."""
        while len(self._entries) > self.max_entries or sum(self._sizes.values()) > self.max_bytes:
            oldest = next((k for k, f in self._entries.items() if f.done() and k != keep), None)
            if oldest is None:
                return
            del self._entries[oldest]
            self._sizes.pop(oldest, None)

    def __len__(self) -> int:
        return len(self._entries)

