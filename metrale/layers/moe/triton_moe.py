"""The experts' SwiGLU as two grouped GEMMs, one Triton launch each for all experts.

The idea is vLLM's fused_moe; the code is ours. Each (token, k) pair is an *assignment*
a = token * top_k + k. Assignments are sorted by expert and each expert's run padded to a
multiple of BLOCK_M (`kernels/moe_align.py`), so every BLOCK_M-row tile of the sorted list
belongs to one expert. A program computes one [BLOCK_M, BLOCK_N] tile of

    GEMM 1: act[a]  = silu(hidden[a // top_k] @ gate[e]^T) * (hidden[a // top_k] @ up[e]^T)  (K = H)
    GEMM 2: out[a]  = act[a] @ w2[e]^T * weight[a]                                        (N = H, K = I)

gathering its A rows through the sorted ids and scattering C rows back to assignment order;
padding rows and assignments of experts outside this rank's range are never written (out stays
zero there). With `fuse_silu`, GEMM 1's program reads the gate rows and the matching up rows of
w13 ([gate; up]) and applies SiLU-and-mul in its epilogue, rounding as
`kernels/activation.silu_and_mul` does on the model-dtype outputs of the two products; otherwise
GEMM 1 writes [gate | up] and `silu_and_mul` follows (always for the clamped SwiGLU of GLM-5.3).
The per-token sum over k is a plain reduction. Shapes are bounded without reading the routing on
the host (no device sync), which keeps the path CUDA-graph friendly.

Tiles (and whether GEMM 1 fuses SiLU-and-mul) come from `moe_gemm_configs`: a table measured per
shape and GPU by benchmarks/moe_gemm_sweep.py (layers/moe/tuned_moe_gemm.json), a rule elsewhere.
"""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch

from metrale.kernels import interpret_mode, tl, triton
from metrale.kernels.activation import silu_and_mul
from metrale.kernels.moe_align import align_assignments
from metrale.layers.activation import clamp_swiglu


@triton.jit
def _tile_dot(acc, a, b, IEEE_FP32: tl.constexpr):
    if IEEE_FP32:  # float32 models get float32 products, not TF32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["num_assign"])  # varies every step: no recompiles
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weight_ptr, sorted_ids_ptr, block_expert_ptr,
                         N, K, num_assign, a_row_divisor, up_offset,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         MUL_WEIGHT: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
                         IEEE_FP32: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid: (num_tiles * cdiv(N, BLOCK_N),); C[a, n] = sum_k A[a // a_row_divisor, k] * B[e, n, k].
    # SILU_MUL: C[a, n] = silu(that) * (the same over B's row n + up_offset), each product rounded
    # to C's dtype first (as F.linear then silu_and_mul would).
    pid = tl.program_id(0)
    # Builtins only (no tl.cdiv / tl.zeros, which are @jit helpers of triton.language): those break
    # under the interpreter when triton was imported before TRITON_INTERPRET was set.
    num_n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = pid // num_n_tiles, pid % num_n_tiles
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_mask = assign < num_assign
    a_row = assign // a_row_divisor
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # SILU_MUL only
    for k0 in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _tile_dot(acc, a, b, IEEE_FP32)
        if SILU_MUL:
            if EVEN_K:
                b_up = tl.load(b_ptrs + up_offset, mask=n_mask[None, :], other=0.0)
            else:
                b_up = tl.load(b_ptrs + up_offset, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = _tile_dot(acc_up, a, b_up, IEEE_FP32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    dtype = c_ptr.dtype.element_ty
    if SILU_MUL:
        gate = acc.to(dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + assign, mask=row_mask, other=0.0)[:, None]
    c_ptrs = c_ptr + assign[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(dtype), mask=row_mask[:, None] & n_mask[None, :])


class MoeGemmConfig(NamedTuple):
    block_m: int  # rows (assignments) per tile: the alignment of every expert's run, shared by both GEMMs
    block_n: int  # output columns per tile (of act when GEMM 1 fuses SiLU-and-mul)
    block_k: int
    num_warps: int = 4
    num_stages: int = 3  # software pipeline depth (the interpreter ignores it)
    fuse_silu: bool = False  # GEMM 1 only: SiLU-and-mul in the epilogue instead of a separate launch


def _grouped_gemm(a, b, c, weights, sorted_ids, block_expert, a_row_divisor, cfg: MoeGemmConfig,
                  silu_mul: bool = False):
    num_assign = c.shape[0]
    n, k = (b.shape[1] // 2 if silu_mul else b.shape[1]), b.shape[2]
    grid = (block_expert.shape[0] * triton.cdiv(n, cfg.block_n),)
    _grouped_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, sorted_ids, block_expert,
        n, k, num_assign, a_row_divisor, n * b.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        MUL_WEIGHT=weights is not None, SILU_MUL=silu_mul, EVEN_K=k % cfg.block_k == 0,
        IEEE_FP32=a.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


TUNED_TABLE = os.path.join(os.path.dirname(__file__), "tuned_moe_gemm.json")


@functools.lru_cache(maxsize=None)
def _tuned_table(capability: tuple[int, int]) -> dict:
    """{(experts, top_k, hidden, intermediate, dtype): [(tokens, gate_up config, down config), ...]
    ascending} of the table's entries measured on this compute capability."""
    with open(TUNED_TABLE) as f:
        doc = json.load(f)
    table: dict = {}
    for e in doc["entries"]:
        if tuple(e["capability"]) != capability:
            continue
        key = (e["experts"], e["top_k"], e["hidden"], e["intermediate"], e["dtype"])
        table.setdefault(key, []).append((e["tokens"], MoeGemmConfig(*e["gate_up"]), MoeGemmConfig(*e["down"])))
    return {key: sorted(rows) for key, rows in table.items()}


def _rule_configs(num_assign: int, num_experts: int, hidden: int, inter: int) -> tuple[MoeGemmConfig, MoeGemmConfig]:
    """Tiles for shapes the table lacks (and the CPU interpreter), the layer's first heuristic:
    16-row tiles up to 32 assignments per expert (decode batches spread over many experts waste a
    tall tile on padding), 64 above; 64 x 32 tiles, 4 warps, 3 stages, SiLU-and-mul launched
    apart. The sweep's entries replace it shape by shape; until one is measured, a shape runs as
    it did before the table existed."""
    block_m = 16 if num_assign <= 2 * num_experts * 16 else 64
    return MoeGemmConfig(block_m, 64, 32), MoeGemmConfig(block_m, 64, 32)


def moe_gemm_configs(num_assign: int, num_experts: int, top_k: int, hidden: int, inter: int,
                     dtype: torch.dtype, device: torch.device) -> tuple[MoeGemmConfig, MoeGemmConfig]:
    """(GEMM 1 with SiLU-and-mul, GEMM 2) tiles for `num_assign` assignments over `num_experts`
    local experts: the table's entry for this shape and GPU at the smallest measured token count
    >= num_assign / top_k (the largest past the end), else `_rule_configs`. A pure function of
    the shapes: the same step always runs the same tiles."""
    if device.type == "cuda" and not interpret_mode():
        rows = _tuned_table(torch.cuda.get_device_capability(device)).get(
            (num_experts, top_k, hidden, inter, str(dtype).removeprefix("torch.")))
        if rows:
            tokens = num_assign / top_k
            _, gate_up, down = next((r for r in rows if r[0] >= tokens), rows[-1])
            return gate_up, down
    return _rule_configs(num_assign, num_experts, hidden, inter)


def configs_up_to(max_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                  device: torch.device) -> list[tuple[MoeGemmConfig, MoeGemmConfig]]:
    """Every (GEMM 1, GEMM 2) pair `moe_gemm_configs` picks for 1..max_tokens tokens: the choice
    changes only at the table's token counts and the rule's block_m bound, so those points and
    their neighbours cover it. The kernel warm-up compiles them before serving."""
    bound = 32 * num_experts // top_k  # the rule's block_m changes past this many tokens
    points = {1, max_tokens, bound, bound + 1}
    if device.type == "cuda" and not interpret_mode():
        rows = _tuned_table(torch.cuda.get_device_capability(device)).get(
            (num_experts, top_k, hidden, inter, str(dtype).removeprefix("torch.")), [])
        points |= {t for r in rows for t in (r[0], r[0] + 1)}
    picks = (moe_gemm_configs(t * top_k, num_experts, top_k, hidden, inter, dtype, device)
             for t in sorted(points) if 1 <= t <= max_tokens)
    return list(dict.fromkeys(picks))


def compile_tiles(w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int, expert_start: int = 0,
                  swiglu_limit: float | None = None) -> int:
    """Launch `fused_experts_triton` on two tokens with each tile pair a step of up to
    max_tokens tokens can take, over these very weights (so the compiled variants are the ones
    serving launches); returns how many pairs."""
    num_local, two_i, hidden = w13.shape
    pairs = configs_up_to(max_tokens, num_local, top_k, hidden, two_i // 2, w13.dtype, w13.device)
    x = torch.zeros(2, hidden, dtype=w13.dtype, device=w13.device)
    ids = (torch.arange(2 * top_k, device=w13.device).view(2, top_k) % num_local) + expert_start
    weights = torch.full((2, top_k), 1.0 / top_k, device=w13.device)
    for pair in pairs:
        fused_experts_triton(x, w13, w2, weights, ids, expert_start, configs=pair, swiglu_limit=swiglu_limit)
    return len(pairs)


def fused_experts_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, expert_start: int = 0,
                         configs: tuple[MoeGemmConfig, MoeGemmConfig] | None = None,
                         swiglu_limit: float | None = None) -> torch.Tensor:
    """Same contract as `fused_experts_reference`: hidden [T, H] -> [T, H]. `configs` replaces
    `moe_gemm_configs` (tests, benchmarks); both must share block_m."""
    num_tokens, top_k = topk_ids.shape
    num_local, two_i, hidden_size = w13.shape
    num_assign = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    gate_up_cfg, down_cfg = configs or moe_gemm_configs(num_assign, num_local, top_k, hidden_size, two_i // 2,
                                                        hidden.dtype, hidden.device)
    assert gate_up_cfg.block_m == down_cfg.block_m, (gate_up_cfg, down_cfg)
    sorted_ids, block_expert = align_assignments(topk_ids, gate_up_cfg.block_m, num_local, expert_start)
    # Rows of foreign assignments hold garbage in act; GEMM 2 never reads them.
    if gate_up_cfg.fuse_silu and swiglu_limit is None:
        act = torch.empty((num_assign, two_i // 2), dtype=hidden.dtype, device=hidden.device)
        _grouped_gemm(hidden, w13, act, None, sorted_ids, block_expert, top_k, gate_up_cfg, silu_mul=True)
    else:
        inter = torch.empty((num_assign, two_i), dtype=hidden.dtype, device=hidden.device)
        _grouped_gemm(hidden, w13, inter, None, sorted_ids, block_expert, top_k, gate_up_cfg)
        act = silu_and_mul(inter if swiglu_limit is None else clamp_swiglu(inter, swiglu_limit))
    out = torch.zeros((num_assign, hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(act, w2, out, weights, sorted_ids, block_expert, 1, down_cfg)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
