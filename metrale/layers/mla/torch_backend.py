"""The reference MLA backend: plain PyTorch over the paged latent cache, CPU or CUDA.

One sequence at a time: gather its latents (cached prefix and new tokens, in position order),
then attention with the query rows placed at the end of the context. A sequence with one query
row takes the absorbed form, any other the up-projected one (backend.py); both are exported for
the test that they agree. A selection (`topk_indices`, DSA) becomes the boolean mask both forms
already take: row j sees exactly its listed positions. Slow and obviously right; a fast backend
is tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.config.cache_config import FP8
from metrale.layers.attention.torch_backend import gather_context
from metrale.layers.cache_backend import register_backend
from metrale.layers.forward_context import AttentionMetadata
from metrale.layers.mla.backend import LatentUpProjection, MLABackend


def write_latent_reference(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                           slot_mapping: torch.Tensor, latent_scale: float = 1.0) -> None:
    block_size = cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    entries = torch.cat((kv_c[keep], k_pe[keep]), dim=-1)
    if cache.dtype == FP8:  # x * (1 / scale) in float32, saturated: the Triton write's numbers
        entries = (entries.float() * (1.0 / latent_scale)).clamp(-448.0, 448.0)
    cache[slots // block_size, slots % block_size] = entries.to(cache.dtype)


def causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[query_len, seq_len]: query row j sits at position seq_len - query_len + j and sees keys
    0..that position."""
    positions = torch.arange(seq_len - query_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= positions[:, None]


def selection_mask(topk_indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    """topk_indices [Q, K] (positions, -1 padding) -> [Q, seq_len] bool, True where listed."""
    listed = topk_indices.long()
    mask = torch.zeros(listed.shape[0], seq_len + 1, dtype=torch.bool, device=listed.device)
    # -1 lands in the extra last column, which is dropped.
    mask.scatter_(1, torch.where(listed >= 0, listed, seq_len), True)
    return mask[:, :seq_len]


def up_projected_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor,
                           up: LatentUpProjection, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """q_nope [Q, H, nope], q_pe [Q, H, rope]; entries [S, rank + rope] (one sequence's cache
    rows) -> [Q, H, v]: k and v from kv_b_proj over the latents, k_pe shared by every head."""
    heads, nope, v_dim = q_nope.shape[1], up.qk_nope_head_dim, up.v_head_dim
    rank = up.w_uk.shape[2]
    latents, k_pe = entries[:, :rank], entries[:, rank:]
    kv = up.kv_b_proj(latents).view(-1, heads, nope + v_dim)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, heads, -1)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor,
                       up: LatentUpProjection, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """The same attention with W_UK folded into the query and W_UV applied after it: MQA of
    [q_nope W_UK | q_pe] over the cache entries, the latent as the value."""
    heads, rank = q_nope.shape[1], up.w_uk.shape[2]
    q_latent = torch.bmm(q_nope.transpose(0, 1), up.w_uk)  # [H, Q, rank]
    q = torch.cat((q_latent, q_pe.transpose(0, 1)), dim=-1)  # [H, Q, rank + rope]
    k = entries[None].expand(heads, -1, -1)  # [H, S, rank + rope]: one head, shared
    v = entries[None, :, :rank].expand(heads, -1, -1)
    attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [H, Q, rank]
    return torch.bmm(attended, up.w_uv.transpose(1, 2)).transpose(0, 1)  # [Q, H, v]


@register_backend
class TorchMLABackend(MLABackend):
    name = "torch"
    supports_nope = True

    def write_latent(self, kv_c, k_pe, cache, slot_mapping, latent_scale: float = 1.0) -> None:
        write_latent_reference(kv_c, k_pe, cache, slot_mapping, latent_scale)

    def forward(self, q_nope, q_pe, cache, up: LatentUpProjection, metadata: AttentionMetadata,
                scale: float, topk_indices: torch.Tensor | None = None, latent_scale: float = 1.0) -> torch.Tensor:
        out = q_nope.new_empty(*q_nope.shape[:2], up.v_head_dim)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            if query_len == 0:
                continue
            rows = slice(start, start + query_len)
            entries = gather_context(cache, metadata.block_tables[i], seq_len).to(q_nope.dtype)
            if cache.dtype == FP8:
                entries = entries * latent_scale
            attend = absorbed_attention if query_len == 1 else up_projected_attention
            if topk_indices is None:
                mask = causal_mask(query_len, seq_len, q_nope.device)
            else:
                mask = selection_mask(topk_indices[rows], seq_len)
            out[rows] = attend(q_nope[rows], q_pe[rows], entries, up, scale, mask)
            start += query_len
        return out
