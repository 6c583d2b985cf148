"""The Triton MLA backend (cache kind "mla"): the fast path on CUDA, tested against the PyTorch
reference (tests/layers/test_mla_triton_backend.py, tests/gpu/test_gpu_mla_backend.py).

- Pure decode steps: the absorbed form for every row. q_nope @ W_UK and the attended latent @
  W_UV^T stay torch bmms around kernels/mla_decode.py (split-KV MQA over the paged latents). No
  host read and a split count fixed by the block table's width: it replays in CUDA graphs.
- Mixed steps (prefill and extend chunks, with or without decodes): the batch is split once, from
  the host lists the step's layout already carries. Sequences of one query row take the absorbed
  form as above (rows mapped to their sequences); the others are up-projected: their contexts'
  latents are gathered from the cache in one index, kv_b_proj gives k_nope and v, and
  kernels/mla_extend.py attends with q/k head size != v's, causal over the prefix.
- A selection (`topk_indices`, DSA): every row takes the absorbed form over its listed positions,
  decode or not. Sparse rows see at most K keys, so up-projecting a whole context for them would
  cost more than attending over the latent (DeepSeek's own sparse prefill is absorbed too).
- Verify graphs' steps (speculative decoding, q rows per sequence): every row absorbed, mapped
  to its sequence with its own key count (VerifyRowMap), as a decode over q causal rows.
- The latent write is a Triton scatter (kernels/mla_latent_write.py), graph-safe.
- An fp8 latent cache: written as value / latent_scale, read back times it (both kernels fold the
  scale; the extend path's gather dequantizes before kv_b_proj).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from metrale.kernels import HAS_TRITON
from metrale.kernels.mla_decode import mla_decode_attention
from metrale.kernels.mla_extend import mla_extend_attention
from metrale.kernels.mla_latent_write import write_latent_triton
from metrale.layers.cache_backend import register_backend
from metrale.layers.forward_context import AttentionMetadata, BatchLayout
from metrale.layers.mla.backend import LatentUpProjection, MLABackend

if not HAS_TRITON:
    raise ImportError("triton is not installed")


@dataclass
class MixedStepPlan:
    """How a step that is not a pure decode splits (device tensors built once per step)."""

    decode_rows: torch.Tensor  # int64 [D]: query rows of the sequences with one query row
    decode_seqs: torch.Tensor  # int32 [D]: their sequences
    decode_kv_lens: torch.Tensor  # int32 [D]: their sequences' lengths
    extend_seqs: torch.Tensor  # int32 [E]: the sequences of more than one query row
    extend_cu_k: torch.Tensor  # int32 [E + 1]: their contexts' rows in the up-projected K/V
    extend_token_seqs: torch.Tensor  # int64 [S]: each context token's sequence
    extend_token_positions: torch.Tensor  # int64 [S]: and its position
    extend_max_query_len: int
    row_seqs: torch.Tensor  # int32 [T]: every row's sequence (sparse rows)
    row_kv_lens: torch.Tensor  # int32 [T]: every row's position + 1

    @classmethod
    def of(cls, layout: BatchLayout) -> "MixedStepPlan":
        device = layout.seq_lens.device
        query_lens, seq_lens = layout.query_lens_cpu, layout.seq_lens_cpu
        starts = [0, *itertools.accumulate(query_lens)]
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        extend = [i for i, n in enumerate(query_lens) if n > 1]
        row_seqs = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens, dtype=torch.int64))
        context_lens = torch.tensor([seq_lens[i] for i in extend], dtype=torch.int64)
        token_seqs = torch.repeat_interleave(torch.tensor(extend, dtype=torch.int64), context_lens)
        starts_k = torch.repeat_interleave(torch.cumsum(context_lens, 0) - context_lens, context_lens)
        token_positions = torch.arange(int(context_lens.sum())) - starts_k

        def tensor(values, dtype):
            return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            decode_rows=tensor([starts[i] for i in decode], torch.int64),
            decode_seqs=tensor(decode, torch.int32),
            decode_kv_lens=tensor([seq_lens[i] for i in decode], torch.int32),
            extend_seqs=tensor(extend, torch.int32),
            extend_cu_k=tensor([0, *itertools.accumulate(seq_lens[i] for i in extend)], torch.int32),
            extend_token_seqs=tensor(token_seqs, torch.int64),
            extend_token_positions=tensor(token_positions, torch.int64),
            extend_max_query_len=max((query_lens[i] for i in extend), default=0),
            row_seqs=tensor(row_seqs, torch.int32),
            row_kv_lens=(layout.positions[:row_seqs.shape[0]] + 1).to(torch.int32),
        )


@dataclass
class VerifyRowMap:
    """A verify graph's rows (BatchLayout.uniform_query_len = q) mapped onto their sequences for
    the absorbed decode: row r belongs to sequence r // q and sees its keys up to its position
    (a dummy row: its sequence's last real position). Device arithmetic alone: graph-safe."""

    row_seq: torch.Tensor  # int32 [num_seqs * q]
    row_kv_len: torch.Tensor  # int32 [num_seqs * q]

    @classmethod
    def of(cls, layout: BatchLayout) -> "VerifyRowMap":
        q = layout.uniform_query_len
        rows = torch.arange(layout.seq_lens.shape[0] * q, device=layout.seq_lens.device, dtype=torch.int32)
        row_seq = rows // q
        real = layout.real_query_lens[row_seq]
        row_kv_len = layout.seq_lens[row_seq] - real + torch.minimum(rows % q, real - 1) + 1
        return cls(row_seq, row_kv_len.to(torch.int32))


@dataclass
class TritonMLAMetadata(AttentionMetadata):
    mixed: MixedStepPlan | None = None  # None on a pure decode step (nothing host-built: graph-safe)
    verify_rows: VerifyRowMap | None = None  # a verify graph's step (then mixed is None too)


def absorbed(q_nope, q_pe, cache, up: LatentUpProjection, block_tables, seq_lens, scale, latent_scale,
             **rows) -> torch.Tensor:
    """[R, heads, v]: W_UK into the query, the decode kernel over the latents, W_UV out."""
    q_latent = torch.bmm(q_nope.transpose(0, 1), up.w_uk).transpose(0, 1)  # [R, heads, rank]
    attended = mla_decode_attention(q_latent, q_pe, cache, block_tables, seq_lens, scale,
                                    latent_scale=latent_scale, **rows)
    return torch.bmm(attended.transpose(0, 1), up.w_uv.transpose(1, 2)).transpose(0, 1)


@register_backend
class TritonMLABackend(MLABackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_verify_graphs = True

    def build_metadata(self, layout: BatchLayout) -> TritonMLAMetadata:
        base = AttentionMetadata.of(layout)
        verify = VerifyRowMap.of(layout) if layout.uniform_query_len > 1 else None
        mixed = None if layout.is_pure_decode or verify is not None else MixedStepPlan.of(layout)
        return TritonMLAMetadata(**{f: getattr(base, f) for f in AttentionMetadata.__dataclass_fields__},
                                 mixed=mixed, verify_rows=verify)

    def write_latent(self, kv_c, k_pe, cache, slot_mapping, latent_scale: float = 1.0) -> None:
        write_latent_triton(kv_c, k_pe, cache, slot_mapping, latent_scale)

    def forward(self, q_nope, q_pe, cache, up: LatentUpProjection, metadata: TritonMLAMetadata, scale: float,
                topk_indices: torch.Tensor | None = None, latent_scale: float = 1.0) -> torch.Tensor:
        tables, seq_lens, plan = metadata.block_tables, metadata.seq_lens, metadata.mixed
        if metadata.verify_rows is not None:  # a verify graph: every row absorbed, causal by its key count
            rows = metadata.verify_rows
            return absorbed(q_nope, q_pe, cache, up, tables, seq_lens, scale, latent_scale,
                            topk_indices=topk_indices, row_seq=rows.row_seq, row_kv_len=rows.row_kv_len)
        if plan is None:  # pure decode: row i is sequence i
            return absorbed(q_nope, q_pe, cache, up, tables, seq_lens, scale, latent_scale,
                            topk_indices=topk_indices)
        if topk_indices is not None:
            return absorbed(q_nope, q_pe, cache, up, tables, seq_lens, scale, latent_scale,
                            topk_indices=topk_indices, row_seq=plan.row_seqs, row_kv_len=plan.row_kv_lens)
        out = q_nope.new_empty(*q_nope.shape[:2], up.v_head_dim)
        if plan.decode_rows.numel():
            rows = plan.decode_rows
            out[rows] = absorbed(q_nope[rows], q_pe[rows], cache, up, tables, seq_lens, scale, latent_scale,
                                 row_seq=plan.decode_seqs, row_kv_len=plan.decode_kv_lens)
        if plan.extend_seqs.numel():
            self._up_projected(q_nope, q_pe, cache, up, metadata, scale, latent_scale, out)
        return out

    @staticmethod
    def _up_projected(q_nope, q_pe, cache, up, metadata, scale, latent_scale, out) -> None:
        plan, block_size = metadata.mixed, cache.shape[1]
        positions = plan.extend_token_positions
        blocks = metadata.block_tables[plan.extend_token_seqs, positions // block_size].long()
        entries = cache.view(-1, cache.shape[2])[blocks * block_size + positions % block_size].to(q_nope.dtype)
        if cache.dtype == torch.float8_e4m3fn:
            entries = entries * latent_scale
        rank, heads = up.w_uk.shape[2], q_nope.shape[1]
        latents, k_pe = entries[:, :rank], entries[:, rank:]
        k_nope, v = up.kv_b_proj(latents).view(-1, heads, up.qk_nope_head_dim + up.v_head_dim).split(
            [up.qk_nope_head_dim, up.v_head_dim], dim=-1)
        mla_extend_attention(q_nope, q_pe, k_nope, k_pe, v, metadata.query_start_loc, metadata.seq_lens,
                             plan.extend_seqs, plan.extend_cu_k, plan.extend_max_query_len, scale, out)
