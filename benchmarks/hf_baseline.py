"""The same workloads through Hugging Face transformers, for the comparison in docs/benchmarks.md.

    python benchmarks/hf_baseline.py latency --model Qwen3-8B --input-len 512 --output-len 128
    python benchmarks/hf_baseline.py throughput --model Qwen3-0.6B --num-prompts 64 --max-new-tokens 256

Random weights from the shipped config (as `--load-format dummy`), bf16, on CUDA. The throughput
run uses transformers' continuous batching (`generate_batch`), which takes one max_new_tokens
for all requests: it runs the first --num-prompts prompts of the nano-vllm workload with that
many new tokens each, and reports that run's output tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metrale.bench.workload import random_workload  # noqa: E402
from metrale.startup.model_source import resolve_model_dir  # noqa: E402


def build(model: str, overrides: str = ""):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_dir(model, "dummy"))
    for key, value in (json.loads(overrides) if overrides else {}).items():  # as met's --hf-overrides
        setattr(config, key, value)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return hf.eval()


@torch.no_grad()
def latency(args) -> dict:
    model = build(args.model, args.hf_overrides)
    rng = random.Random(0)
    prompt = torch.tensor([[rng.randrange(10000) for _ in range(args.input_len)]], device="cuda")

    def timed(new_tokens):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(4)
    ttft = min(timed(1) for _ in range(2))
    total = min(timed(args.output_len) for _ in range(2))
    return {"framework": "transformers", "benchmark": "latency", "ttft_s": ttft,
            "tpot_s": (total - ttft) / (args.output_len - 1)}


@torch.no_grad()
def throughput(args) -> dict:
    from transformers import GenerationConfig

    model = build(args.model, args.hf_overrides)
    work = random_workload(256, (100, 1024), (100, 1024), 0)
    prompts = work.prompts[:args.num_prompts]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=config)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    return {"framework": "transformers", "benchmark": "throughput", "num_prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "output_tokens": tokens, "seconds": seconds,
            "output_tokens_per_s": tokens / seconds}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("bench", choices=("latency", "throughput"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--hf-overrides", default="", help="JSON object of config fields to replace (met's flag)")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    result = {"latency": latency, "throughput": throughput}[args.bench](args)
    result["model"] = args.model
    result["hf_overrides"] = args.hf_overrides
    try:
        import fla  # noqa: F401  (transformers' Gated DeltaNet layers take its kernels when it imports)
        result["fla"] = getattr(fla, "__version__", "yes")
    except ImportError:
        result["fla"] = None
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
