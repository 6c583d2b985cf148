"""Benchmark workloads: random prompts of token ids, and what a run must read per step."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from metrale.engine.sampling_params import SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def input_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def output_lens(self) -> list[int]:
        return [p.max_tokens for p in self.params]


def random_workload(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0,
                    max_token_id: int = 10000, temperature: float = 0.6) -> Workload:
    """nano-vllm's bench.py workload with its defaults: after random.seed(seed), prompts of
    uniform lengths with token ids uniform in 0..max_token_id, then output lengths, ignore_eos."""
    random.seed(seed)
    prompts = [[random.randint(0, max_token_id) for _ in range(random.randint(*input_range))]
               for _ in range(num_prompts)]
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=random.randint(*output_range))
              for _ in range(num_prompts)]
    return Workload(prompts, params)


def weights_read_per_step(model: torch.nn.Module, tokens_per_step: int) -> tuple[int, int]:
    """(bytes, parameters) a step of `tokens_per_step` tokens must read: every weight except the
    input embedding (only its rows are gathered), and for MoE layers only the experts the tokens
    can reach (at most top_k x tokens of them)."""
    from metrale.layers.vocab import ParallelLMHead, VocabParallelEmbedding

    seen: set[int] = set()
    total_bytes = total_params = 0
    lm_head_weights = {id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead)}
    for module in model.modules():
        experts = getattr(module, "num_experts", None)
        top_k = getattr(module, "top_k", None)
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead) \
                    and id(p) not in lm_head_weights:
                continue
            share = 1.0
            if experts and top_k and p.dim() == 3 and p.shape[0] == experts:
                share = min(experts, top_k * tokens_per_step) / experts
            total_bytes += int(p.numel() * p.element_size() * share)
            total_params += int(p.numel() * share)
    return total_bytes, total_params
