"""The vision layers' index arithmetic and M-RoPE against transformers' own helpers, and the
batched segment attention against one SDPA call per segment."""

import pytest
import torch
import torch.nn.functional as F

from metrale.layers.mrope import MRotaryEmbedding
from metrale.layers.vision.attention import segment_attention
from metrale.layers.vision.grid import interpolated_table_index, patch_positions, window_partition

GRIDS = torch.tensor([[1, 4, 4], [2, 6, 8], [1, 10, 6]])


def test_window_partition_matches_transformers():
    from transformers.vision_utils import get_vision_window_index

    for window_units in (1, 2, 3):
        index, cu = window_partition(GRIDS, 2, window_units)
        expected_index, expected_cu = get_vision_window_index(GRIDS, spatial_merge_size=2,
                                                              window_size=window_units * 28, patch_size=14)
        assert index.tolist() == expected_index.tolist() and cu.tolist() == expected_cu.tolist()
        assert sorted(index.tolist()) == list(range(index.numel()))  # a permutation


def test_patch_positions_and_table_resampling_match_transformers():
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    assert patch_positions(GRIDS, 2).tolist() == get_vision_position_ids(GRIDS, 2).tolist()
    index, weight = interpolated_table_index(GRIDS, 5, 2)
    expected_index, expected_weight = get_vision_interpolation_indices_and_weights(
        GRIDS, num_grid_per_side=5, mode="bilinear", align_corners=True, spatial_merge_size=2)
    table = torch.randn(25, 8, dtype=torch.float64)
    torch.testing.assert_close((table[index] * weight[..., None].double()).sum(1),
                               (table[expected_index] * expected_weight[..., None].double()).sum(1))


def test_segment_attention_equals_one_call_per_segment():
    torch.manual_seed(0)
    q, k, v = (torch.randn(40, 2, 8) for _ in range(3))
    cu = [0, 8, 16, 16, 19, 27, 40]  # equal lengths batched, an empty and ragged ones alone
    out = segment_attention(q, k, v, cu, 0.3)
    for start, end in zip(cu[:-1], cu[1:]):
        if end > start:
            part = [x[start:end].transpose(0, 1)[None] for x in (q, k, v)]
            torch.testing.assert_close(out[start:end], F.scaled_dot_product_attention(*part, scale=0.3)[0].transpose(0, 1))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_matches_transformers_rotary(family):
    import transformers

    section = [2, 3, 3]
    if family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLTextConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                     "mrope_section": section})
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding as Reference
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb as apply
    else:
        config = transformers.Qwen3VLTextConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                                rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                 "mrope_section": section, "mrope_interleaved": True})
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Reference
        from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb as apply
    ours = MRotaryEmbedding(config, 16, 64, section, interleaved=family == "qwen3_vl")
    # The last column is past the 64 positions of the cos/sin cache (a video's time row can be).
    positions = torch.tensor([[0, 1, 2, 9, 9, 9, 9, 300], [0, 1, 2, 3, 3, 4, 4, 13], [0, 1, 2, 3, 4, 3, 4, 13]])
    q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    cos, sin = Reference(config)(q, positions[:, None, :])
    expected = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got = ours(positions, q, k)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e[0].transpose(0, 1))
    # Equal rows are plain RoPE, and [T] means that.
    flat = torch.arange(8)
    for a, b in zip(ours(flat.expand(3, -1), q, k), ours(flat, q, k)):
        assert torch.equal(a, b)
