from metrale.layers.attention.layer import Attention

__all__ = ["Attention"]
