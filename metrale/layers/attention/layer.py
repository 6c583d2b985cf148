"""The Attention layer models use: q, k, v in, heads out. The layer owns its prologue (the
optional per-head q/k norms, RoPE and the K/V write) and picks how to run it, so a model never
needs to know which launches fuse:

- on CUDA with a backend that reads the cache as the Triton KV write leaves it: one launch for
  the norms (when they are plain RMSNorms), RoPE and the K/V store (rope_store_kv_triton);
- otherwise the norms, then RoPE, then the backend's write_kv.

It is a CachedLayer: one paged spec of two planes (K and V) of [kv_heads, head_dim] per token,
in the element type CacheConfig gives its model layer.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.cache_config import FP8, CacheConfig
from metrale.kernels import use_triton
from metrale.layers.cache_spec import PagedCacheSpec
from metrale.layers.forward_context import get_forward_context
from metrale.layers.norm import RMSNorm

KIND = "attention"


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, layer_index: int,
                 rotary=None, qk_norm: tuple[nn.Module, nn.Module] | None = None):
        """`rotary`: the RotaryEmbedding applied to q and k (None: no positions). `qk_norm`: the
        (q_norm, k_norm) modules applied to each head before RoPE; they stay their owner's
        submodules (the checkpoint names them there), the layer only calls them."""
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.layer_index = layer_index
        self.rotary = rotary
        self._qk_norm = qk_norm  # a tuple: not registered as submodules
        self._fused_norm = _fusable_norm_weights(qk_norm)
        # Bound by the model runner once the pool exists: (k_cache, v_cache), each
        # [num_blocks, block_size, num_kv_heads, head_dim].
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # Per-layer scales of an fp8 cache (stored value = x / scale): from the checkpoint's
        # k_scale / v_scale, from calibration, or 1.0. Plain floats: CUDA graphs bake them in.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # While calibrating, the largest |K| and |V| this layer has produced.
        self.observed_amax: list[float] | None = None

    # -- the cache ---------------------------------------------------------------------------

    def cache_specs(self, config: CacheConfig) -> tuple[PagedCacheSpec]:
        return (PagedCacheSpec(KIND, 2, (self.num_kv_heads, self.head_dim), config.kv_dtype(self.layer_index)),)

    def bind_caches(self, caches: tuple[torch.Tensor, ...] | None) -> None:
        if caches is None:
            self.kv_cache = None
            return
        (kv,) = caches
        self.kv_cache = (kv[0], kv[1])
        if kv.dtype != FP8:  # scales mean something only to an fp8 cache
            self.k_scale = self.v_scale = 1.0

    @property
    def cache_dtype(self) -> torch.dtype | None:
        return None if self.kv_cache is None else self.kv_cache[0].dtype

    # -- the forward pass --------------------------------------------------------------------

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v of the step's tokens, q and k BEFORE their norms and RoPE; [T, heads x head_dim] out."""
        ctx = get_forward_context()
        if self.kv_cache is None:
            raise RuntimeError(f"the KV cache is not bound to the attention of layer {self.layer_index}")
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        backend, metadata = ctx.backends[KIND], ctx.metadata[KIND]
        fused_norm = self._fused_norm
        if self._can_fuse_prologue(q, backend):
            from metrale.kernels.qk_norm_rope import rope_store_kv_triton

            if fused_norm is None:
                q, k = self._norms(q, k)
            rope = self.rotary
            rows, table = rope.kernel_table(positions)
            rope_store_kv_triton(rows, q, k, v, table, rope.rotary_dim, rope.is_neox_style,
                                 qk_norm=fused_norm, kv_cache=self.kv_cache, slot_mapping=metadata.slot_mapping,
                                 k_scale=self.k_scale, v_scale=self.v_scale)
        else:
            q, k = self._norm_and_rope(positions, q, k, fused_norm)
            if self.observed_amax is not None:
                self.observed_amax[0] = max(self.observed_amax[0], k.abs().max().item())
                self.observed_amax[1] = max(self.observed_amax[1], v.abs().max().item())
            k_cache, v_cache = self.kv_cache
            backend.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
        k_cache, v_cache = self.kv_cache
        out = backend.forward(q, k_cache, v_cache, metadata, self.scale, self.k_scale, self.v_scale)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def _can_fuse_prologue(self, q: torch.Tensor, backend) -> bool:
        """RoPE and the K/V write in one kernel: on CUDA, with a backend that reads the cache as
        the Triton KV write leaves it, and not while fp8 scales are calibrated (which must see K
        and V)."""
        return (self.rotary is not None and use_triton(q) and backend.fused_prologue
                and self.observed_amax is None)

    def _norms(self, q, k):
        if self._qk_norm is None:
            return q, k
        q_norm, k_norm = self._qk_norm
        return q_norm(q), k_norm(k)

    def _norm_and_rope(self, positions, q, k, fused_norm):
        if self.rotary is None:
            return self._norms(q, k)
        if fused_norm is not None and use_triton(q):  # norms and RoPE in one launch, in place
            from metrale.kernels.qk_norm_rope import qk_norm_rope_triton

            rope = self.rotary
            rows, table = rope.kernel_table(positions)
            return qk_norm_rope_triton(rows, q, k, *fused_norm, table, rope.rotary_dim, rope.is_neox_style)
        return self.rotary(positions, *self._norms(q, k))


def _fusable_norm_weights(qk_norm):
    """(q_weight, k_weight, eps) when the q/k norms are plain RMSNorms of one eps, which the Triton
    prologue applies itself; None otherwise (no norms, or another kind). The weights are the norms'
    parameters, loaded in place later."""
    if qk_norm is None:
        return None
    q_norm, k_norm = qk_norm
    if type(q_norm) is not RMSNorm or type(k_norm) is not RMSNorm or q_norm.eps != k_norm.eps:
        return None
    return q_norm.weight, k_norm.weight, q_norm.eps
