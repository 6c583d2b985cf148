"""The Triton attention backend: the fast path on CUDA.

Pure decode steps (one query token per sequence) take split-KV flash decoding, whose split
count depends only on the block table's width, so it replays inside CUDA graphs; so do verify
graphs' steps (q rows per sequence: the same kernel over q causal query rows); every other
step takes the extend kernel (prefill chunks and decodes mixed, causal over the paged prefix).
Models with RoPE write K and V from their RoPE kernel (`fused_prologue`), not through write_kv.
Tested against the PyTorch backend (tests/kernels, tests/gpu).
"""

from __future__ import annotations

import torch

from metrale.layers.forward_context import AttentionMetadata
from metrale.kernels import HAS_TRITON
from metrale.kernels.kv_cache_write import write_kv_cache_triton
from metrale.kernels.paged_attention import decode_attention_triton, extend_attention_triton
from metrale.layers.attention.backend import AttentionBackend
from metrale.layers.cache_backend import register_backend

if not HAS_TRITON:
    raise ImportError("triton is not installed")


@register_backend
class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_verify_graphs = True
    # A prefill graph's layout (one sequence padded to a token bucket, executor/cuda_graphs.py)
    # runs the extend kernel as it is: the padding rows come after the real ones.
    supports_prefill_graphs = True
    fused_prologue = True

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(self, q: torch.Tensor, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        if metadata.uniform_query_len > 1:  # a verify graph: q rows per sequence, the first real ones causal
            return decode_attention_triton(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale,
                                           k_scale=k_scale, v_scale=v_scale, num_queries=metadata.uniform_query_len,
                                           query_lens=metadata.real_query_lens)
        if metadata.is_pure_decode:
            return decode_attention_triton(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale,
                                           k_scale=k_scale, v_scale=v_scale)
        return extend_attention_triton(q, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc,
                                       metadata.seq_lens, metadata.max_query_len, scale, k_scale, v_scale)
