"""How many KV blocks the pool gets: fixed, from a byte budget, or from free device memory."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 2 << 30


def num_kv_blocks(*, fixed: int | None, budget_bytes: int | None, bytes_per_block: int, block_size: int,
                  max_num_seqs: int, max_model_len: int, device: torch.device,
                  gpu_memory_utilization: float, activation_bytes: int = 0) -> int:
    """Blocks for the pool. Never more than max_num_seqs full-length sequences can use."""
    blocks_per_seq = -(-max_model_len // block_size)
    if fixed is not None:
        return fixed
    if budget_bytes is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            used = total - free
            budget_bytes = int(total * gpu_memory_utilization) - used - activation_bytes
        else:
            budget_bytes = CPU_DEFAULT_KV_BYTES
    blocks = min(budget_bytes // bytes_per_block, max_num_seqs * blocks_per_seq)
    if blocks < 1:
        raise RuntimeError(
            f"no memory is left for the KV cache (budget {budget_bytes / 2**20:.0f} MiB, one block needs "
            f"{bytes_per_block / 2**20:.2f} MiB); raise --gpu-memory-utilization or --kv-cache-memory, or "
            f"lower --max-num-batched-tokens")
    if blocks < blocks_per_seq:
        logger.warning("the KV pool holds %d tokens, less than one full-length sequence (%d)",
                       blocks * block_size, max_model_len)
    return blocks
