"""Where a batch-1 speculative step's host time goes: one request of `met bench latency`'s
workload (random prompt, greedy, ignore_eos), plain and with drafts, each engine.step() timed and
the speculative run under cProfile (host functions by own time; the GPU's work shows as the
synchronizing calls that wait for it).

    PYTHONPATH=. python3 benchmarks/spec_step_profile.py --model demo
    PYTHONPATH=. python3 benchmarks/spec_step_profile.py --model metrale/model_configs/Qwen3-8B --load-format dummy

Prints per run: steps, ms per step, ms per generated token (plain synchronous, plain with the
engine's default scheduling, speculative), then the profile's top functions.
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metrale import LLM  # noqa: E402
from metrale.messages.sampling_params import SamplingParams  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def one_request(engine, prompt, output_len, tag, profile=None):
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request(tag, {"prompt_token_ids": prompt}, params)
    steps = []
    if profile is not None:
        profile.enable()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    if profile is not None:
        profile.disable()
    return steps


def run(args, label, **engine_kwargs):
    llm = LLM(args.model, load_format=args.load_format, skip_tokenizer_init=True, max_model_len=2048,
              max_num_seqs=8, **engine_kwargs)
    engine = llm.llm_engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(3)]
    for i in range(2):
        one_request(engine, prompts[i], args.output_len, f"warmup{i}")
    profile = cProfile.Profile() if engine_kwargs.get("speculative_config") else None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps = one_request(engine, prompts[2], args.output_len, "measured", profile)
    decode = steps[1:]  # the first step is the prefill
    print(f"{label:>24}: scheduling {'async' if engine.async_scheduling else 'sync'}, {len(steps)} steps, "
          f"decode {sum(decode) / len(decode) * 1e3:.3f} ms/step, {sum(decode) / (args.output_len - 1) * 1e3:.3f} "
          f"ms/token, slowest step {max(decode) * 1e3:.2f} ms")
    if profile is not None:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.rows)
        print(out.getvalue())
    del llm, engine


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM))
    parser.add_argument("--rows", type=int, default=30, help="profile rows")
    args = parser.parse_args()
    run(args, "plain, synchronous", async_scheduling=False)
    run(args, "plain, default")
    run(args, "speculative", speculative_config=json.loads(args.speculative_config))


if __name__ == "__main__":
    main()
