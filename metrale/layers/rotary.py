"""Rotary position embeddings, from the checkpoint's rope parameters.

Frequencies come from `transformers`' own rope initialisers for scaled variants (llama3, yarn,
linear, dynamic...), so the numbers are the reference's. cos and sin are cached in float32 for
every position up to the context length and cast to the activation dtype at use, as the
reference does.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.kernels import use_triton


def rope_parameters(hf_config) -> dict:
    """{rope_theta, rope_type, ...} from a transformers v5 (`rope_parameters`) or v4 config."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inverse_frequencies(hf_config, rotary_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(hf_config)
    if params["rope_type"] == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {params['rope_type']!r} is not supported")
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, torch.device("cpu"))


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [x0, x2, ... | x1, x3, ...] along the last dimension: a neox rotation
    of the result is the interleaved (DeepSeek) rotation of x, de-interleaved, as transformers'
    apply_rotary_pos_emb_interleave returns it."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_position: int, rotary_dim: int | None = None,
                 is_neox_style: bool = True):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.is_neox_style = is_neox_style
        with torch.device("cpu"):  # the rope initialisers compute on the host, whatever device builds us
            inv_freq, scaling = inverse_frequencies(hf_config, self.rotary_dim)
        inv_freq = inv_freq.to(torch.get_default_device())
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # [max_position, rotary_dim]: first half cos, second half sin (the kernels' layout).
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1),
                             persistent=False)

    def kernel_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, table) for the fused kernels, which rotate token t by table[rows[t]] (first half
        cos, second half sin): here the positions and the cache. M-RoPE (layers/mrope.py) gives a
        table of the step's own angles instead."""
        return positions, self.cos_sin_cache

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]. Returns them rotated:
        in place on CUDA (the fused kernel), as new tensors elsewhere."""
        if use_triton(q):
            from metrale.kernels.rotary import apply_rotary_triton

            return apply_rotary_triton(positions, q, k, self.cos_sin_cache, self.rotary_dim, self.is_neox_style)
        cos, sin = self.cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        rotate = _rotate_neox if self.is_neox_style else _rotate_gptj
        return self._apply(q, cos, sin, rotate), self._apply(k, cos, sin, rotate)

    def _apply(self, x, cos, sin, rotate):
        if self.rotary_dim == self.head_dim:
            return rotate(x, cos, sin)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((rotate(rot, cos, sin), rest), dim=-1)
