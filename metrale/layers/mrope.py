"""Multimodal RoPE (M-RoPE) of the Qwen2-VL family: positions are three rows (temporal, height,
width) per token, and each rotary frequency takes its angle from one of the rows.

`mrope_section` = [n_t, n_h, n_w] frequencies (sum = rotary_dim / 2) say how many go to each row:
- contiguous (Qwen2-VL, Qwen2.5-VL): frequencies [0, n_t) read row t, the next n_h row h, the
  next n_w row w;
- interleaved (Qwen3-VL, `mrope_interleaved`): frequency j reads row h when j % 3 == 1 and
  j < 3 * n_h, row w when j % 3 == 2 and j < 3 * n_w, else row t.
Either way the rotation itself is the ordinary neox one of RotaryEmbedding with the same
frequencies, so a token whose three rows are equal (all text) is rotated exactly as by plain
RoPE: one-row positions [T] are accepted and mean that (and read the cos/sin cache).

The fused Triton prologues of the Attention layer rotate token t by table[rows[t]]
(`kernel_table`): for [3, T] positions the table is this step's own cos/sin per token and rows
are 0..T-1, so the same kernels serve M-RoPE.
"""

from __future__ import annotations

import torch

from metrale.layers.rotary import RotaryEmbedding, _rotate_neox, inverse_frequencies, rope_parameters


def frequency_rows(mrope_section: list[int], interleaved: bool) -> torch.Tensor:
    """[sum(mrope_section)] int64: the position row (0 t, 1 h, 2 w) each frequency reads."""
    n = sum(mrope_section)
    if not interleaved:
        return torch.cat([torch.full((size,), i % 3, dtype=torch.int64) for i, size in enumerate(mrope_section)])
    rows = torch.zeros(n, dtype=torch.int64)
    for row in (1, 2):
        rows[row:mrope_section[row] * 3:3] = row
    return rows


class _DefaultRope:
    """A rope_parameters view where "mrope" (the 4.x configs' rope type) reads as "default":
    M-RoPE changes which position each frequency reads, not the frequencies."""

    def __init__(self, hf_config):
        self.rope_parameters = dict(rope_parameters(hf_config), rope_type="default")


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(self, hf_config, head_dim: int, max_position: int, mrope_section: list[int],
                 interleaved: bool, rotary_dim: int | None = None):
        """`rotary_dim` < head_dim: only the first rotary_dim features of each head turn (Qwen3.5's
        partial rotary); the sections cover rotary_dim / 2 frequencies."""
        params = rope_parameters(hf_config)
        if params["rope_type"] not in ("default", "mrope"):
            raise ValueError(f"M-RoPE with rope type {params['rope_type']!r} is not supported")
        rotary_dim = rotary_dim or head_dim
        if sum(mrope_section) * 2 != rotary_dim:
            raise ValueError(f"mrope_section {mrope_section} does not cover the rotary dim {rotary_dim} (sum * 2)")
        super().__init__(_DefaultRope(hf_config), head_dim, max_position, rotary_dim=rotary_dim)
        with torch.device("cpu"):
            inv_freq, _ = inverse_frequencies(_DefaultRope(hf_config), rotary_dim)
        device = self.cos_sin_cache.device
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("frequency_rows", frequency_rows(list(mrope_section), interleaved).to(device),
                             persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, rotary_dim] float32 (cos | sin) of positions [3, T]. Computed, not looked up: a
        video's time row may run past the context length (it grows by tokens_per_second per
        temporal patch, not per token). The product is the one the cache holds (float32 position
        x inverse frequency), so inside the cache the values are the cache's."""
        angles = positions.t()[:, self.frequency_rows].float() * self.inv_freq  # [T, rotary_dim / 2]
        return torch.cat((angles.cos(), angles.sin()), dim=-1)

    def kernel_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return positions, self.cos_sin_cache
        return torch.arange(positions.shape[1], device=positions.device), self.cos_sin(positions)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: int64 [3, T] (rows t, h, w) or [T] (all rows equal)."""
        cos_sin = self.cos_sin_cache[positions] if positions.dim() == 1 else self.cos_sin(positions)
        cos, sin = cos_sin.to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        return self._apply(q, cos, sin, _rotate_neox), self._apply(k, cos, sin, _rotate_neox)
