"""What the multi-rank tests share (CPU with gloo in tests/distributed, GPUs with NCCL in
tests/gpu): tiny checkpoints that exercise every way a model splits, prompts, a free port."""

from __future__ import annotations

import socket

from checkpoints import make_checkpoint
from hybrid_checkpoints import make_hybrid_checkpoint
from moe_checkpoints import make_moe_checkpoint

PROMPT_LENGTHS = (1, 6, 23, 41)

CHECKPOINTS = {
    # 4 attention heads, 2 KV heads: both divide over 2 ranks.
    "qwen3": (make_checkpoint, "qwen3", {}),
    # One KV head: replicated on both TP ranks.
    "llama_kv1": (make_checkpoint, "llama", {"num_key_value_heads": 1}),
    # 8 experts, softmax routing, layer 1 dense.
    "qwen3_moe": (make_moe_checkpoint, "qwen3_moe", {}),
    # 5 experts (ranges [0, 2) and [2, 5) over 2 EP ranks), one KV head, full-width q/k norms.
    "minimax_m2_uneven": (make_moe_checkpoint, "minimax_m2", {"num_local_experts": 5, "num_key_value_heads": 1}),
    # Hybrid: 2 linear-attention key heads and 4 value heads, each rank holding one key head's group.
    "qwen3_next": (make_hybrid_checkpoint, "qwen3_next", {}),
    "qwen3_5": (make_hybrid_checkpoint, "qwen3_5", {}),
}


def build_checkpoint(name: str, directory: str) -> str:
    make, family, overrides = CHECKPOINTS[name]
    return make(directory, family, **overrides)


def make_prompts() -> list[list[int]]:
    return [[(37 * i + 11 * n) % 380 + 3 for i in range(n)] for n in PROMPT_LENGTHS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
