"""Structured outputs on the GPU: throughput of concurrent JSON-schema requests against the same
requests unconstrained, and the token bitmask's cost per step at batch 1.

    PYTHONPATH=. python3 benchmarks/structured_bench.py --model Qwen3-8B --load-format dummy
    PYTHONPATH=. python3 benchmarks/structured_bench.py --model DIR            # a real checkpoint
    PYTHONPATH=. python3 benchmarks/structured_bench.py --model DIR --device cpu --requests 8 --max-tokens 32

The bitmask's cost follows the vocabulary, so a model without a tokenizer of its own (the
shipped configs of --load-format dummy) gets a synthetic byte-level BPE of the model's vocabulary
size (`--tokenizer DIR` uses a real one, e.g. Qwen3's). With random weights every request runs to
--max-tokens, constrained or not (the schema asks for a long array), so both runs produce the
same tokens per request and compare per-token throughput at a full batch.

Prints a markdown table: (1) output tokens/s of --requests concurrent requests (256) without and
with a JSON schema, and the ratio (issue 18's bar: the constrained run within 10%); (2) at batch
1: the host's bitmask work per step (matchers catching up and filling the row, the copy
launched), the bitmask kernel's device time (CUDA events), and the median step time of one
request without and with the schema, both with synchronous scheduling (a constrained step waits
for the step before it), so the difference is the bitmask's (the bar: under 50 us).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

# A long array of small objects: random weights never finish it before --max-tokens.
SCHEMA = {
    "type": "array",
    "minItems": 400,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                       "name": {"type": "string", "pattern": "^[a-z]{1,12}$"},
                       "ok": {"type": "boolean"},
                       "kind": {"enum": ["alpha", "beta", "gamma"]}},
        "required": ["id", "name", "ok", "kind"],
        "additionalProperties": False,
    },
}


def synthetic_tokenizer(vocab_size: int, path: str) -> str:
    """A byte-level BPE of about `vocab_size` tokens, its merges drawn deterministically: word
    pieces with and without a leading space, digits, punctuation, as real vocabularies hold."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = sorted(alphabet)
    seen = set(tokens)
    letters = [c for c in "abcdefghijklmnopqrstuvwxyz"] + ["Ġ" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    pieces = letters + list("0123456789{}[]\":,. _-")
    merges = []
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    target = vocab_size - len(specials) - 300  # room for the padding a checkpoint keeps past the tokenizer
    pool = [t for t in pieces if t in seen]
    while len(tokens) < target:
        left = rng.choice(pool) if rng.random() < 0.7 else rng.choice(tokens)
        right = rng.choice(pieces) if rng.random() < 0.8 else rng.choice(pool)
        if right.startswith("Ġ") or left + right in seen or len(left + right) > 16 or right not in seen:
            continue
        merges.append((left, right))
        tokens.append(left + right)
        seen.add(left + right)
        pool.append(left + right)
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)
    return path


def build_llm(args, tokenizer_dir: str | None):
    from metrale import LLM

    kwargs = dict(load_format=args.load_format, max_num_seqs=args.requests, async_scheduling=args.async_scheduling)
    if args.device:
        kwargs["device"] = args.device
    if tokenizer_dir:
        kwargs["tokenizer"] = tokenizer_dir
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    return LLM(args.model, **kwargs)


def prompts(n: int, length: int, vocab: int) -> list[dict]:
    rng = random.Random(1)
    return [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(length)]} for _ in range(n)]


def throughput(llm, args) -> list[tuple[str, float, int]]:
    from metrale import SamplingParams
    from metrale.messages.structured_outputs import StructuredOutputsParams

    vocab = len(llm.get_tokenizer())
    batch = prompts(args.requests, args.prompt_len, vocab)
    free = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    constrained = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llm.llm_engine.grammars.compile(constrained.structured_outputs)  # compiled once, before timing
    llm.generate(batch[:4], free, use_tqdm=False)  # warm
    rows = []
    for name, params in (("unconstrained", free), ("JSON schema", constrained)):
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append((name, tokens / seconds, tokens))
        if name == "JSON schema":
            bad = [o for o in outs if not o.outputs[0].text.startswith("[")]
            if bad:
                print(f"warning: {len(bad)} constrained outputs do not start the array", file=sys.stderr)
    return rows


def step_times(llm, params, steps: int) -> list[float]:
    """Wall time of each engine step of one request (decode steps only)."""
    engine = llm.llm_engine
    engine.add_request("bench", prompts(1, 16, len(llm.get_tokenizer()))[0], params)
    times = []
    engine.step()  # the prefill
    while engine.has_unfinished_requests() and len(times) < steps:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if engine.has_unfinished_requests():
        engine.abort_request("bench")
        while engine.has_unfinished_requests():
            engine.step()
    return times


def batch_one(llm, args) -> dict[str, float]:
    import torch

    from metrale import SamplingParams
    from metrale.kernels.token_bitmask import apply_token_bitmask
    from metrale.messages.structured_outputs import StructuredOutputsParams

    runner = llm.llm_engine.runner
    llm.llm_engine.async_scheduling = False  # both runs synchronous: the difference is the bitmask's
    spec = StructuredOutputsParams(json=SCHEMA)
    free = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 2, ignore_eos=True, seed=0)
    constrained = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 2, seed=0,
                                 structured_outputs=spec)
    host = []
    original = runner._token_bitmask

    def timed(request_ids, states):
        start = time.perf_counter()
        out = original(request_ids, states)
        if out is not None:
            host.append(time.perf_counter() - start)
        return out

    runner._token_bitmask = timed
    try:
        step_times(llm, free, 8)  # warm
        free_steps = step_times(llm, free, args.steps)
        constrained_steps = step_times(llm, constrained, args.steps)
    finally:
        runner._token_bitmask = original
    result = {"host bitmask work per step (us)": statistics.median(host) * 1e6,
              "step, unconstrained (us)": statistics.median(free_steps) * 1e6,
              "step, JSON schema (us)": statistics.median(constrained_steps) * 1e6}
    result["step difference (us)"] = result["step, JSON schema (us)"] - result["step, unconstrained (us)"]
    if runner.device.type == "cuda":
        vocab = runner.sampled_vocab_size or runner.model_config.vocab_size
        logits = torch.randn(1, vocab, device=runner.device, dtype=runner.model_config.dtype)
        bitmask = torch.randint(-2**31, 2**31 - 1, (1, -(-vocab // 32)), dtype=torch.int32, device=runner.device)
        rows = torch.zeros(1, dtype=torch.int64, device=runner.device)
        times = []
        for _ in range(50):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            apply_token_bitmask(logits, bitmask, rows)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        result["bitmask kernel, device (us)"] = statistics.median(times[5:])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen3-8B")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the model's, or a "
                                                            "synthetic one of the model's vocabulary size)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed at batch 1")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args()

    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None and args.load_format == "dummy":
        from metrale.startup.model_source import resolve_model_dir

        model_dir = resolve_model_dir(args.model, args.load_format)
        if not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
            with open(os.path.join(model_dir, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            tokenizer_dir = synthetic_tokenizer(vocab, tempfile.mkdtemp(prefix="met-structured-bench-"))
            print(f"synthetic byte-level BPE tokenizer of {vocab} tokens in {tokenizer_dir}", file=sys.stderr)
    llm = build_llm(args, tokenizer_dir)
    engine = llm.llm_engine
    print(f"model {args.model} ({args.load_format}), {engine.device}, vocabulary {len(llm.get_tokenizer())}, "
          f"scheduling {'asynchronous' if engine.async_scheduling else 'synchronous'} (constrained steps "
          f"wait for the step before them)\n")
    rows = throughput(llm, args)
    print(f"| {args.requests} concurrent requests, {args.max_tokens} tokens each | output tokens/s | tokens |")
    print("|---|---|---|")
    for name, rate, tokens in rows:
        print(f"| {name} | {rate:,.0f} | {tokens} |")
    ratio = rows[1][1] / rows[0][1]
    print(f"| JSON schema / unconstrained | {ratio:.3f} ({(1 - ratio) * 100:+.1f}% cost) | |\n")
    print("| batch 1 | us |")
    print("|---|---|")
    for name, value in batch_one(llm, args).items():
        print(f"| {name} | {value:,.1f} |")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
