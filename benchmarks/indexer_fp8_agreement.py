"""How many of the bf16 indexer cache's top-k selections the fp8 indexer cache keeps, at
DeepSeek-V3.2's indexer shapes (64 heads of 128, the first 64 dims roped, index_topk 2048,
hidden 7168, q_lora_rank 1536), over contexts of 4k-8k tokens.

The weights are random at the checkpoints' init scale (normal, std initializer_range = 0.02;
k_norm's LayerNorm at its init, weight 1 and bias 0), the hidden states and q_resid random at
unit scale (the RMSNorm outputs the indexer reads). Each context is one prefill: every row at
position p >= index_topk (rows that drop positions) selects from positions 0..p, once with the
keys as the bfloat16 cache stores them and once as the fp8 cache does (e4m3 keys, a float32
scale per token: metrale/layers/mla/indexer_fp8.py), through the PyTorch reference's scoring
and selection (metrale/layers/mla/indexer_torch_backend.py). Agreement = kept / selected,
summed over rows. The issue's bar is 98%.

    python benchmarks/indexer_fp8_agreement.py                     # GPU, contexts 4096 6144 8192
    python benchmarks/indexer_fp8_agreement.py --device cpu --contexts 2560 --rows 64   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from metrale.layers.mla.indexer import DSAIndexer, IndexerDims
from metrale.layers.mla.indexer_fp8 import dequantize_keys, quantize_keys
from metrale.layers.mla.indexer_torch_backend import index_scores, top_positions
from metrale.layers.rotary import RotaryEmbedding

HIDDEN, Q_LORA_RANK, HEADS, HEAD_DIM, ROPE_DIM, TOPK, INIT_STD = 7168, 1536, 64, 128, 64, 2048, 0.02


class _RopeConfig:  # DeepSeek-V3.2's rope base; its yarn scaling moves no score's rank here
    rope_parameters = {"rope_theta": 10000.0, "rope_type": "default"}


def make_indexer(device: torch.device, generator: torch.Generator) -> DSAIndexer:
    with torch.device(device):
        indexer = DSAIndexer(IndexerDims(HIDDEN, Q_LORA_RANK, HEADS, HEAD_DIM, ROPE_DIM, TOPK), rope_interleaved=False)
    with torch.no_grad():
        for linear in (indexer.wq_b, indexer.wk, indexer.weights_proj):
            linear.weight.normal_(0.0, INIT_STD, generator=generator)
        indexer.k_norm.weight.fill_(1.0)
        indexer.k_norm.bias.zero_()
    return indexer


@torch.no_grad()
def agreement(indexer: DSAIndexer, rotary: RotaryEmbedding, context: int, rows: int | None,
              generator: torch.Generator, device: torch.device, chunk: int) -> tuple[int, int]:
    """(kept, selected) over one context's rows at positions >= TOPK (a random `rows` of them)."""
    dtype = torch.bfloat16
    hidden = torch.randn(context, HIDDEN, generator=generator, device=device).to(dtype)
    q_resid = torch.randn(context, Q_LORA_RANK, generator=generator, device=device).to(dtype)
    positions = torch.arange(context, device=device)
    q = indexer.wq_b(q_resid).view(context, HEADS, HEAD_DIM)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(1)
    q, k = indexer._rope(positions, q, k, rotary)
    keys_bf16 = k.squeeze(1).to(dtype).float()
    keys_fp8 = dequantize_keys(*quantize_keys(k.squeeze(1).to(dtype)))
    weights = indexer.weights_proj(hidden) * indexer.weight_scale
    candidates = torch.arange(TOPK, context, device=device)
    if rows is not None and rows < len(candidates):
        candidates = candidates[torch.randperm(len(candidates), generator=generator, device=device)[:rows]]
    kept = selected = 0
    for start in range(0, len(candidates), chunk):
        row_positions = candidates[start:start + chunk]
        allowed = torch.arange(context, device=device)[None, :] <= row_positions[:, None]
        qs, ws = q[row_positions], weights[row_positions]
        picks_bf16 = top_positions(index_scores(qs, ws, keys_bf16), allowed, TOPK).long()
        picks_fp8 = top_positions(index_scores(qs, ws, keys_fp8), allowed, TOPK).long()
        in_fp8 = torch.zeros(len(row_positions), context + 1, dtype=torch.bool, device=device)
        in_fp8.scatter_(1, torch.where(picks_fp8 >= 0, picks_fp8, context), True)
        listed = picks_bf16 >= 0
        kept += int((in_fp8.gather(1, torch.where(listed, picks_bf16, context)) & listed).sum())
        selected += int(listed.sum())
    return kept, selected


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 6144, 8192])
    parser.add_argument("--rows", type=int, default=None, help="rows per context (random); default: all past TOPK")
    parser.add_argument("--chunk", type=int, default=128, help="rows scored at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    torch.set_default_dtype(torch.bfloat16)  # the model dtype: projections, k_norm and the rope in bf16
    indexer = make_indexer(device, generator)
    with torch.device(device):
        rotary = RotaryEmbedding(_RopeConfig, ROPE_DIM, max(args.contexts))
    results, total_kept, total_selected = [], 0, 0
    for context in args.contexts:
        started = time.perf_counter()
        kept, selected = agreement(indexer, rotary, context, args.rows, generator, device, args.chunk)
        total_kept, total_selected = total_kept + kept, total_selected + selected
        results.append(dict(context=context, kept=kept, selected=selected, agreement=kept / selected,
                            seconds=round(time.perf_counter() - started, 2)))
        if not args.json:
            print(f"context {context:6d}: {kept / selected:.4%} of {selected:,} bf16 selections kept by fp8 "
                  f"({results[-1]['seconds']} s)")
    overall = total_kept / total_selected
    if args.json:
        print(json.dumps(dict(device=str(device), shapes=dict(heads=HEADS, head_dim=HEAD_DIM, rope_dim=ROPE_DIM,
                                                              index_topk=TOPK), contexts=results,
                              agreement=overall)))
    else:
        print(f"agreement {overall:.4%} (fp8 keeps this fraction of the bf16 top-{TOPK} selections; bar: 98%)")


if __name__ == "__main__":
    main()
