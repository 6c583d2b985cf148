"""Host time of one engine step, with the model and the sampler's device work stubbed out.

What stays is everything Python does around a step: scheduling, the runner's input preparation
(numpy, pinned host tensors), the sampling rows, and applying the results (scheduler update,
stop checks, detokenizer bookkeeping). On the GPU this work sits on the critical path of every
synchronous step, so it bounds throughput at many running requests. Runs on the CPU:

    python benchmarks/host_overhead.py --running 256 --steps 200
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metrale import LLM, SamplingParams  # noqa: E402
from metrale.executor import model_runner  # noqa: E402
from metrale.executor.sampler import SampledTokens  # noqa: E402

TINY = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 1,
        "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 1000}


class StubModel(torch.nn.Module):
    """Zeros of the right shapes, at no cost: only the host work around the model is left."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.hidden, self.vocab = hidden, vocab

    def forward(self, input_ids, positions):
        return torch.zeros(input_ids.shape[0], self.hidden)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.vocab)


def stub_sampler(logits, rows):
    return SampledTokens(torch.full((len(rows),), 7, dtype=torch.long), rows, [], None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    llm = LLM("Qwen3-0.6B", load_format="dummy", skip_tokenizer_init=True, hf_overrides=TINY, device="cpu",
              max_model_len=4096, max_num_seqs=args.running, num_kv_blocks=args.running * 80,
              enable_prefix_caching=True)
    engine = llm.llm_engine
    engine.runner.model = StubModel(64, 1000)
    model_runner.sample_tokens = stub_sampler
    params = SamplingParams(temperature=0.6, max_tokens=3000, ignore_eos=True, output_kind="final_only")
    for i in range(args.running):
        engine.add_request(str(i), {"prompt_token_ids": [(i * 31 + j) % 997 for j in range(args.prompt_len)]}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(f"{len(engine.scheduler.running)} running decodes: host {statistics.median(times) * 1e3:.3f} ms/step "
          f"(median of {args.steps}; p90 {sorted(times)[int(0.9 * len(times))] * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
