"""CacheConfig: how the engine's caches store what they store, derived once from EngineArgs.

The layers' cache specs (metrale/layers/cache_spec.py) read it: the element type of each
attention layer's K/V (the model dtype, another float type, or fp8 with per-layer scales, some
layers kept in the model dtype by their model layer number), of the recurrent state of
linear-attention layers (`--ssm-h-dtype`) and of the DSA indexer's keys (`--indexer-cache-dtype`:
the model dtype, bfloat16, or fp8 keys with one float32 scale per token, layers/mla/indexer_fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
_FLOAT_TYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    model_dtype: torch.dtype
    kv_cache_dtype: str = "auto"  # auto | float32 | bfloat16 | float16 | fp8
    kv_cache_skip_layers: frozenset[int] = frozenset()  # model layer numbers kept in the model dtype under fp8
    ssm_state_dtype: torch.dtype = torch.float32
    indexer_cache_dtype: str = "auto"  # auto | bfloat16 | fp8

    @classmethod
    def from_args(cls, args, model_dtype: torch.dtype) -> "CacheConfig":
        return cls(block_size=args.block_size, model_dtype=model_dtype, kv_cache_dtype=args.kv_cache_dtype,
                   kv_cache_skip_layers=args.kv_cache_skip_layers, ssm_state_dtype=_FLOAT_TYPES[args.ssm_h_dtype],
                   indexer_cache_dtype=args.indexer_cache_dtype)

    def kv_dtype(self, layer_index: int) -> torch.dtype:
        """The element type of model layer `layer_index`'s K/V cache."""
        if self.kv_cache_dtype == "auto" or (self.kv_cache_dtype == "fp8" and layer_index in self.kv_cache_skip_layers):
            return self.model_dtype
        return FP8 if self.kv_cache_dtype == "fp8" else _FLOAT_TYPES[self.kv_cache_dtype]

    def indexer_key_dtype(self) -> torch.dtype:
        """The element type of the DSA indexer's cached keys (FP8: with a float32 scale per token)."""
        if self.indexer_cache_dtype == "auto":
            return self.model_dtype
        return FP8 if self.indexer_cache_dtype == "fp8" else _FLOAT_TYPES[self.indexer_cache_dtype]
