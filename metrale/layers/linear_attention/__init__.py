"""Linear attention: the Gated DeltaNet layer (Qwen3-Next, Qwen3.5) and its backends."""

from metrale.layers.linear_attention.gated_delta_net import GatedDeltaNet

__all__ = ["GatedDeltaNet"]
