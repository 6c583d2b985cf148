"""Multi-head latent attention (DeepSeek-V2/V3 style): the layer, its cache kind "mla" and backends."""

from metrale.layers.mla.layer import MLAAttention, MLADims

__all__ = ["MLAAttention", "MLADims"]
