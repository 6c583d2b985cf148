"""A toy stateful model that proves the state-slot machinery on CPU before any real hybrid model.

ToyStateForCausalLM is a two-layer Llama whose second layer's token mixer is a running sum
instead of attention: for each request, s_t = 0.5 s_{t-1} + x_t and the mixer outputs s_t. The
sum lives in the request's state slot (a StateCacheSpec of kind "running_sum"), so a wrong slot,
a stale state after preemption, a chunk boundary that drops a carry or a prefix hit that skips a
token all change the greedy tokens. The reference is transformers' LlamaForCausalLM with that
layer's self-attention replaced by the same recurrence over the whole sequence, recomputed for
every token: nothing is cached there.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.cache_backend import CacheBackend, register_backend
from metrale.layers.cache_spec import StateCacheSpec, StateTensorSpec
from metrale.layers.forward_context import BatchLayout, get_forward_context
from metrale.layers.mlp import GatedMLP
from metrale.models.llama import LlamaForCausalLM
from metrale.models.registry import register_model

ARCHITECTURE = "ToyStateForCausalLM"
KIND = "running_sum"
DECAY = 0.5


@register_backend
class RunningSumBackend(CacheBackend):
    kind, name = KIND, "torch"

    def build_metadata(self, layout: BatchLayout) -> BatchLayout:
        return layout


class RunningSum(nn.Module):
    """A CachedLayer with no weights: the decayed running sum of its inputs, per request."""

    def __init__(self, hidden_size: int, layer_index: int):
        super().__init__()
        self.hidden_size, self.layer_index = hidden_size, layer_index
        self.state: torch.Tensor | None = None

    def cache_specs(self, config):
        return (StateCacheSpec(KIND, (StateTensorSpec("sum", (self.hidden_size,), torch.float32),)),)

    def bind_caches(self, caches):
        self.state = None if caches is None else caches[0]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        layout = get_forward_context().metadata[KIND]
        out = torch.empty_like(hidden)
        starts = layout.query_start_loc.tolist()
        for i, (slot, has_state) in enumerate(zip(layout.state_slots.tolist(), layout.has_initial_state.tolist())):
            s = self.state[slot].clone() if has_state else torch.zeros(self.hidden_size)
            for t in range(starts[i], starts[i + 1]):
                s = DECAY * s + hidden[t].float()
                out[t] = s.to(hidden.dtype)
            self.state[slot] = s
        return out


class ToyStateForCausalLM(LlamaForCausalLM):
    ignored_checkpoint_prefixes = ("model.layers.1.self_attn.",)

    def make_layer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        if layer_index != 1:
            return super().make_layer(config, layer_index)
        hf = config.hf_config
        return self.decoder_layer(config, RunningSum(config.hidden_size, layer_index),
                                  GatedMLP(config.hidden_size, hf.intermediate_size), mixer_name="running_sum")


register_model(ARCHITECTURE, __name__, "ToyStateForCausalLM")


def toy_checkpoint(llama_dir: str, out_dir: str) -> str:
    """A copy of a two-layer Llama checkpoint that names the toy architecture."""
    import json
    import shutil

    shutil.copytree(llama_dir, out_dir)
    path = f"{out_dir}/config.json"
    with open(path) as f:
        config = json.load(f)
    config["architectures"] = [ARCHITECTURE]
    with open(path, "w") as f:
        json.dump(config, f)
    return out_dir


class _ReferenceRunningSum(nn.Module):
    def forward(self, hidden_states, **_kwargs):
        s, outs = torch.zeros_like(hidden_states[:, 0]), []
        for t in range(hidden_states.shape[1]):
            s = DECAY * s + hidden_states[:, t]
            outs.append(s)
        return torch.stack(outs, dim=1), None


def reference_model(llama_dir: str):
    """transformers' Llama with layer 1's attention replaced by the running sum."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    model.model.layers[1].self_attn = _ReferenceRunningSum()
    return model


@torch.no_grad()
def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]
