"""Linear attention: the Gated DeltaNet layer (Qwen3-Next, Qwen3.5), Kimi Delta Attention
(GLM-5.3, kda.py), and their backends."""

from metrale.layers.linear_attention.gated_delta_net import GatedDeltaNet
from metrale.layers.linear_attention.kda import KimiDeltaAttention

__all__ = ["GatedDeltaNet", "KimiDeltaAttention"]
