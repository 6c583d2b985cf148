"""Benchmark workloads: random prompts of token ids, and what a run must read per step."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from metrale.messages.sampling_params import SamplingParams


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


def run_settings(engine) -> dict:
    """What a result depends on besides the workload: model, dtype and the engine's layout."""
    args = engine.args
    return {"model": args.model, "dtype": str(engine.model_config.dtype).removeprefix("torch."),
            "tp_size": args.tp_size, "ep_size": args.ep_size, "world_size": engine.executor.world_size,
            "async_scheduling": engine.async_scheduling, "enforce_eager": args.enforce_eager,
            "max_num_seqs": args.max_num_seqs}


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


def weight_traffic(model: torch.nn.Module) -> tuple[int, int, int, int, float]:
    """(dense bytes, expert bytes, dense params, expert params, top_k / num_experts) of what a
    step reads. The input embedding is excluded (only its rows are gathered) unless it is tied to
    the LM head; MoE expert weights are the 3-D parameters of layers with num_experts and top_k."""
    from metrale.layers.vocab import ParallelLMHead, VocabParallelEmbedding

    seen: set[int] = set()
    dense_bytes = expert_bytes = dense_params = expert_params = 0
    share = 1.0
    lm_head_weights = {id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead)}
    for module in model.modules():
        experts, top_k = getattr(module, "num_experts", None), getattr(module, "top_k", None)
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, VocabParallelEmbedding) and id(p) not in lm_head_weights:
                continue
            if experts and top_k and p.dim() == 3 and p.shape[0] == experts:
                expert_bytes += p.numel() * p.element_size()
                expert_params += p.numel()
                share = top_k / experts
            else:
                dense_bytes += p.numel() * p.element_size()
                dense_params += p.numel()
    return dense_bytes, expert_bytes, dense_params, expert_params, share


def weights_read_per_step(model: torch.nn.Module, tokens_per_step: int) -> tuple[int, int]:
    """(bytes a step of `tokens_per_step` tokens must read, parameters active per token): every
    weight but the input embedding, and of MoE experts only those the tokens can reach (at most
    top_k x tokens of them); per token, only top_k experts compute."""
    dense_bytes, expert_bytes, dense_params, expert_params, share = weight_traffic(model)
    reached = min(1.0, share * tokens_per_step)
    return int(dense_bytes + expert_bytes * reached), int(dense_params + expert_params * share)


def step_weight_bytes(model: torch.nn.Module):
    """tokens -> bytes a step with that many tokens must read (see weights_read_per_step)."""
    dense_bytes, expert_bytes, _, _, share = weight_traffic(model)
    return lambda tokens: int(dense_bytes + expert_bytes * min(1.0, share * tokens))
