"""Kimi Delta Attention (layers/linear_attention/kda.py, the torch backend) against transformers'
Glm5NextTextLinearAttention itself, on random weights, in float32.

Two requests share the state pool: a fresh prefill of both in one step (one of them longer than
a 64-token chunk), a second chunk of one continuing from its saved conv and recurrent state, then
decode steps of both together (the one-token step kernels). Every output row equals the
transformers module's output over the whole sequence, which is causal; both decay forms (GLM-5.3's
lower-bounded sigmoid and the softplus one). Tensor parallel, emulated in one process: each
rank's layer (4 heads as 2/2, and unevenly as 2/1/1) loads its slices, runs the same steps on
its own state, and the ranks' partial outputs sum to the reference (what o_proj's all-reduce
does). Plus the state specs and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

from metrale.config.cache_config import CacheConfig
from metrale.distributed.launch import shard_sizes_of
from metrale.distributed.parallel_state import TensorParallelGroup
from metrale.distributed.topology import resolve_topology
from metrale.layers.forward_context import BatchLayout, ForwardContext, set_forward_context
from metrale.layers.linear_attention.kda import STACKED_PARAMS, KDADims, KimiDeltaAttention
from metrale.layers.linear_attention.kda_backend import KIND
from metrale.layers.linear_attention.kda_torch_backend import TorchKDABackend

HIDDEN, HEADS, HEAD_DIM, KERNEL, SLOTS = 64, 4, 16, 4, 3


def _config(lower_bound) -> Glm5NextTextConfig:
    return Glm5NextTextConfig(hidden_size=HIDDEN, linear_num_heads=HEADS, linear_head_dim=HEAD_DIM,
                              linear_conv_kernel_dim=KERNEL, linear_lower_bound=lower_bound, num_hidden_layers=1,
                              layer_types=["linear_attention"])


def _reference(config) -> Glm5NextTextLinearAttention:
    torch.manual_seed(0)
    module = Glm5NextTextLinearAttention(config, 0).float().eval()
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.rand(param.shape) * 2.0 - 1.0)
            elif name.endswith("o_norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape))
            else:
                param.copy_(0.3 * torch.randn(param.shape))
    return module


def _ours(config, reference, layer: KimiDeltaAttention | None = None) -> KimiDeltaAttention:
    layer = layer or KimiDeltaAttention(KDADims.of(config), 0)
    stacked = {theirs: (ours, shard) for ours, theirs, shard in STACKED_PARAMS}
    params = dict(layer.named_parameters())
    for name, tensor in reference.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in stacked:
            ours, shard = stacked[module]
            param = params[f"{ours}.{leaf}"]
            param.weight_loader(param, tensor, shard)
        else:
            param = params[name]
            getattr(param, "weight_loader", lambda p, t: p.data.copy_(t))(param, tensor)
    spec = layer.cache_specs(CacheConfig(block_size=16, model_dtype=torch.float32))[0]
    layer.bind_caches(tuple(torch.full((SLOTS, *t.shape), float("nan"), dtype=t.dtype) for t in spec.tensors))
    return layer


def _step(layer, pieces: list[tuple[int, torch.Tensor, bool]]) -> list[torch.Tensor]:
    """One step over (state slot, hidden rows, continues a saved state) per request."""
    lens = [rows.shape[0] for _, rows, _ in pieces]
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    decode = all(n == 1 and has for n, (_, _, has) in zip(lens, pieces))
    layout = BatchLayout(positions=torch.zeros(sum(lens), dtype=torch.int64), query_start_loc=starts,
                         seq_lens=torch.tensor(lens, dtype=torch.int32),
                         block_tables=torch.zeros(len(lens), 1, dtype=torch.int32),
                         slot_mapping=torch.full((sum(lens),), -1, dtype=torch.int64),
                         state_slots=torch.tensor([s for s, _, _ in pieces], dtype=torch.int32),
                         has_initial_state=torch.tensor([int(h) for _, _, h in pieces], dtype=torch.int32),
                         max_query_len=max(lens), max_seq_len=max(lens), query_lens_cpu=lens, seq_lens_cpu=lens,
                         is_pure_decode=decode)
    backend = TorchKDABackend()
    ctx = ForwardContext(layout, {KIND: backend.build_metadata(layout)}, {KIND: backend})
    with set_forward_context(ctx), torch.no_grad():
        out = layer(layout.positions, torch.cat([rows for _, rows, _ in pieces]))
    return list(out.split(lens))


def _run_requests(layer, a, b) -> tuple[torch.Tensor, torch.Tensor]:
    """Both requests' outputs: fresh prefills together (slots 2 and 0), a's second chunk from
    its saved state, then three decode steps of both together."""
    got_a, got_b = _step(layer, [(2, a[:30], False), (0, b[:70], False)])
    (more_a,) = _step(layer, [(2, a[30:42], True)])
    rows_a, rows_b = [got_a, more_a], [got_b]
    for t in range(3):
        step_a, step_b = _step(layer, [(2, a[42 + t:43 + t], True), (0, b[70 + t:71 + t], True)])
        rows_a.append(step_a)
        rows_b.append(step_b)
    return torch.cat(rows_a), torch.cat(rows_b)


def _inputs(reference):
    torch.manual_seed(1)
    a, b = torch.randn(45, HIDDEN), torch.randn(73, HIDDEN)  # b: more than one 64-token chunk
    with torch.no_grad():
        return (a, b), tuple(reference(x.unsqueeze(0))[0] for x in (a, b))


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe_gate", "softplus"])
def test_prefill_chunked_prefill_and_decode_match_transformers(lower_bound):
    config = _config(lower_bound)
    reference = _reference(config)
    layer = _ours(config, reference)
    (a, b), (expected_a, expected_b) = _inputs(reference)
    got_a, got_b = _run_requests(layer, a, b)
    torch.testing.assert_close(got_a, expected_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_b, expected_b, rtol=1e-4, atol=1e-4)
    assert torch.isnan(layer.recurrent_state[1]).all()  # the unused slot untouched


@pytest.mark.parametrize("tp, heads_per_rank", [(2, (2, 2)), (3, (2, 1, 1))])
def test_tensor_parallel_ranks_sum_to_transformers(tp, heads_per_rank):
    config = _config(-5.0)
    reference = _reference(config)
    (a, b), (expected_a, expected_b) = _inputs(reference)
    sum_a, sum_b = torch.zeros_like(expected_a), torch.zeros_like(expected_b)
    for rank in range(tp):
        with shard_sizes_of(resolve_topology(tp, 1, rank=rank), "ep"):
            layer = KimiDeltaAttention(KDADims.of(config), 0)
        assert layer.num_heads == heads_per_rank[rank]
        assert layer.recurrent_state is None and layer.cache_specs(
            CacheConfig(block_size=16, model_dtype=torch.float32))[0].tensors[1].shape[0] == heads_per_rank[rank]
        _ours(config, reference, layer)
        layer.o_proj.tp = TensorParallelGroup()  # the test sums the ranks' partial outputs itself
        got_a, got_b = _run_requests(layer, a, b)
        sum_a, sum_b = sum_a + got_a, sum_b + got_b
    torch.testing.assert_close(sum_a, expected_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sum_b, expected_b, rtol=1e-4, atol=1e-4)
    uneven = layer.uneven_head_split()
    assert uneven == (None if tp == 2 else "KDA heads 2/1/1 per rank")


def test_state_specs_are_the_conv_inputs_and_one_state_per_head():
    layer = KimiDeltaAttention(KDADims.of(_config(-5.0)), 7)
    (spec,) = layer.cache_specs(CacheConfig(block_size=16, model_dtype=torch.bfloat16))
    assert spec.kind == "kda"
    assert [(t.name, t.shape) for t in spec.tensors] == [("conv", (KERNEL - 1, 3 * HEADS * HEAD_DIM)),
                                                         ("recurrent", (HEADS, HEAD_DIM, HEAD_DIM))]
    assert spec.tensors[0].dtype == torch.bfloat16


def test_refusals_name_what_is_not_supported():
    config = _config(-5.0)
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="KDA's short convolution runs silu; hidden_act='gelu'"):
        KDADims.of(config)
