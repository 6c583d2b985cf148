"""The routed experts' SwiGLU for decode-sized batches (at most MAX_TOKENS tokens): two GEMV launches.

Same contract as `metrale.layers.moe.reference.fused_experts_reference`:

    hidden  [T, H]          model dtype (bf16 / fp16 / fp32); rows may be strided, last dim contiguous
    w13     [E_local, 2I, H] rows [0, I) gate (w1), [I, 2I) up (w3); contiguous rows
    w2      [E_local, H, I]  down; contiguous rows
    topk_ids [T, k]          global expert ids (any int dtype); this rank holds [expert_start, expert_start + E_local)
    topk_weights [T, k]      float32 or the model dtype
    -> out  [T, H]           model dtype, a new contiguous tensor

Algorithm. Assignment a = token * k + j is the pair (token, its j-th expert). No sorting, no
padding, no host sync:

  Stage 1 (`_gate_up_kernel`, grid (T * k, cdiv(I, BLOCK_I))): program (a, b) reads BLOCK_I gate
      rows and the BLOCK_I matching up rows of w13[e_a] (both tiles issued together) and dots them
      with hidden[token] over H, fp32 accumulation; the epilogue applies SiLU(gate) * up and writes
      act[a, rows] ([T * k, I], model dtype). Assignments vary fastest in the grid, so the programs
      reading one row block of every assignment's expert run at the same time: a repeated expert
      (two tokens routing to it) is streamed from HBM about once and served from L2 otherwise.
      Programs of experts held by another rank return at once and leave their act row unwritten.
  Stage 2, two forms (`MoeGemvConfig.per_assignment`; the default config takes the first):
    per assignment (`_down_per_assignment_kernel`, grid (T * k, cdiv(H, BLOCK_N))): program (a, b)
      reads BLOCK_N rows of w2[e_a] (contiguous) with act[a], reduces over I, scales by the
      routing weight and stores the rounded partial in fp32 ([T * k, H], a per-call buffer). It
      then arrives at the counter of (token, b); the token's k-th arrival sums the k partials in
      slot order, writes out[t, rows] and sets the counter back to zero. A program of another
      rank's expert reads nothing, stores a zero partial and still arrives.
    per token (`_down_kernel`, grid (T, cdiv(H, BLOCK_N))): program (t, b) reads the BLOCK_N rows
      of w2 of all k experts of token t as one [k', BLOCK_N, I-chunk] tile (k' = next power of two
      >= k, the extra slots masked) together with the k act rows, reduces over I, scales by the
      routing weights, and sums over the k experts in registers: one store per output element,
      no atomics, no [T, k, H] buffer. Slots of experts outside this rank's range are masked
      (their loads issue no memory traffic) and contribute exactly zero.
    Either way a token with no local expert gets a zero row.

  Weights are read as in `metrale.kernels.gemv`: every thread issues 16-byte loads along a
  contiguous row ([..., BLOCK_K // VEC, VEC] tiles whose last axis is thread-local), products are
  summed per thread in fp32 and reduced across threads once. Batch size and token counts are no
  kernel argument at all (only the grids depend on T and k), so no batch size compiles its own
  variant and the launches capture into CUDA graphs. k is a constexpr (a model constant).

Numerics: products and sums in fp32. Rounding to the model dtype happens where the reference
(`F.linear` in the model dtype, then `F.silu(gate) * up` in the model dtype) rounds, so a bf16
model sees the same intermediate values up to the fp32 summation order:
  gate, up      rounded after the H-sum (F.linear's output);
  silu(gate)    computed in fp32 from the rounded gate, rounded (F.silu in the model dtype);
  act           silu * up computed in fp32, rounded (the product in the model dtype), stored;
  y = act @ w2[e]^T  rounded after the I-sum (F.linear's output);
  y * weight    computed in fp32 (whatever the weights' dtype), rounded (the reference's product /
                `.to(dtype)`);
  the sum over the k experts in fp32, rounded once at the store. (The reference adds expert
  outputs into a model-dtype tensor one expert at a time, rounding after each add;
  `fused_experts_triton` sums in fp32 and rounds once, as here.) fp32 models: every rounding
  is the identity and only the summation order differs from the reference.

Determinism: no split-K. Every output element is reduced in an order fixed by the launch config,
which is a pure function of (H, I, k, dtype) (`moe_gemv_config`): in one program, or (per
assignment) as k partials summed in slot order by whichever program arrives last; the arrival
order decides only who sums, never the order. Results are bitwise identical from run to run and
independent of the batch size and of which other tokens are in the batch.

Arrival counters: see `metrale/kernels/arrivals.py` (one buffer per device, zero between launches).

Programmatic dependent launch (when enabled, see metrale.kernels): stage 1 waits before its first
read and then lets stage 2 launch. Stage 2 reads the routing (ids, weights) and its first w2
chunk BEFORE waiting (the per-token form; the per-assignment form its routing and first chunk): the routing is not written by stage 1, and stage 2 can only start once every
stage-1 program has passed its own wait, i.e. once every kernel before stage 1 has completed; the
act rows, which stage 1 writes, are read only after the wait.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from metrale.kernels import pdl_args, pdl_launch_dependents, pdl_wait, tl, triton
from metrale.kernels.arrivals import arrival_counters

MAX_TOKENS = 16


def use_small_batch(num_tokens: int, intermediate_size: int = 512) -> bool:
    """Whether `FusedMoE` takes `fused_experts_small_batch_triton` for a CUDA batch of this many
    tokens (else the grouped GEMM of triton_moe). The GEMVs do one product per (assignment, weight
    element) on CUDA cores and re-read an expert's rows (from L2) once per token routed to it, so
    they suit batches where experts see about one token each. The crossover measured on an H200
    (benchmarks/moe_decode_bench.py, docs/benchmarks.md): still 1.18x faster at 16 tokens for
    Qwen3-Next's 512-wide experts, 1.23x at 8 and 0.86x at 16 for Qwen3-30B-A3B's 768-wide ones."""
    return num_tokens <= (MAX_TOKENS if intermediate_size <= 512 else 8)


class MoeGemvConfig(NamedTuple):
    block_i: int   # stage 1: intermediate rows per program (as many gate rows and up rows each)
    block_k1: int  # stage 1: elements of H per chunk
    warps1: int
    block_n: int   # stage 2: output rows per program
    block_k2: int  # stage 2: elements of I per chunk
    warps2: int
    # Both stages' K loops unrolled at compile time (the chunk count is a model constant), so every
    # chunk's loads can be in flight at once instead of one chunk per loop trip.
    unrolled: bool = False
    # Stage 2 as one program per (assignment, BLOCK_N output rows): one expert's rows, contiguous,
    # a partial per assignment, and the last of a token's k programs to arrive sums the k
    # partials in slot order (arrival counters; deterministic).
    per_assignment: bool = False


def _vec(dtype: torch.dtype, block_k: int) -> int:
    """Elements per 16-byte load, capped by the chunk width."""
    return max(1, min(16 // dtype.itemsize, block_k))


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def chunk_width(K: int, cap: int) -> int:
    """The K chunk: the widest power of two <= min(K, cap), or half of it when that divides K and
    the wider one does not (768 -> 256 x 3, not 512 + a masked 256)."""
    block = min(cap, _prev_pow2(K))
    if block > 1 and K % block and K % (block // 2) == 0:
        block //= 2
    return block


MAX_UNROLLED_CHUNKS = 16  # beyond this many chunks the K loop stays a loop (code size)


def moe_gemv_config(hidden_size: int, inter_size: int, top_k: int,
                    dtype: torch.dtype = torch.bfloat16) -> MoeGemvConfig:
    """Default launch config, a pure function of the shapes (no autotuning: determinism), chosen by
    Qwen3-30B-A3B's batch-1 decode through the engine on an H200 (`met bench latency`,
    docs/benchmarks.md) among the configs `benchmarks/moe_decode_bench.py --sweep` ranked best:

      stage 1: two gate rows and the two matching up rows per program, 4 KiB of each row per chunk
               (the whole row at H = 2048 bf16), 8 warps laid out along H: 16 KiB in flight a program.
      stage 2: per assignment (`_down_per_assignment_kernel`): eight output rows of one expert a
               program, 128 elements of I per chunk, the chunks unrolled, 4 warps, and the token's
               last program to arrive sums the k partials.
    Engine steps (ms per token, same job): the first rule (one row pair, one output row over all
    k experts a program) 3.145; this one 2.995. The microbenchmark alone is no guide: configs it
    timed within 1% of each other differed by up to 6% of the engine's step, and two row pairs
    with the first rule's stage 2 made the step slower (3.343).
    Chunks are powers of two no wider than the dimension, so every program has one full chunk.
    """
    elem = dtype.itemsize
    block_k1 = chunk_width(hidden_size, 4096 // elem)
    warps1 = max(1, min(8, block_k1 // (_vec(dtype, block_k1) * 32)))
    block_k2 = chunk_width(inter_size, 128)
    warps2 = max(1, min(4, 8 * block_k2 // (_vec(dtype, block_k2) * 32)))
    unrolled = max(hidden_size // block_k1, inter_size // block_k2) <= MAX_UNROLLED_CHUNKS
    return MoeGemvConfig(block_i=2, block_k1=block_k1, warps1=warps1, block_n=8, block_k2=block_k2,
                         warps2=warps2, unrolled=unrolled, per_assignment=True)


@triton.jit
def _gate_up_acc(acc_g, acc_u, g_ptrs, u_ptrs, x_ptrs):
    # One full chunk: acc [BLOCK_I, BLOCK_K // VEC] += the thread-local VEC sums of w * x.
    g = tl.load(g_ptrs).to(tl.float32)
    u = tl.load(u_ptrs).to(tl.float32)
    x = tl.load(x_ptrs).to(tl.float32)[None, :, :]
    return acc_g + tl.sum(g * x, axis=2), acc_u + tl.sum(u * x, axis=2)


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, ids_ptr, act_ptr,
    hidden_size, inter_size, expert_start, num_local,
    stride_xm, stride_we, stride_wn, stride_am,
    TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    EVEN_K: tl.constexpr, FULL_CHUNKS: tl.constexpr, UNROLLED: tl.constexpr, PDL: tl.constexpr,
):
    # grid: (num_assign, cdiv(I, BLOCK_I)). act[a, i] = silu(x[t] . w13[e, i]) * (x[t] . w13[e, I + i]).
    pdl_wait(PDL)  # the routing and hidden come from earlier kernels
    pdl_launch_dependents(PDL)  # stage 2 may start and prefetch its w2 rows
    a = tl.program_id(0)
    expert = tl.load(ids_ptr + a).to(tl.int64) - expert_start
    if (expert < 0) | (expert >= num_local):  # another rank's expert: stage 2 never reads this row
        return
    token = a // TOP_K
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    imask = offs_i < inter_size
    rows = tl.minimum(offs_i, inter_size - 1).to(tl.int64)  # rows past I re-read row I-1: loads stay unmasked
    # k offsets of one chunk as [BLOCK_K // VEC, VEC]: the last axis is one 16-byte vector per thread
    kk = tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    w_ptrs = w13_ptr + expert * stride_we + kk[None, :, :]
    g_ptrs = w_ptrs + rows[:, None, None] * stride_wn
    u_ptrs = w_ptrs + (rows + inter_size)[:, None, None] * stride_wn
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xm + kk

    acc_g = tl.full([BLOCK_I, BLOCK_K // VEC], 0.0, tl.float32)
    acc_u = tl.full([BLOCK_I, BLOCK_K // VEC], 0.0, tl.float32)
    k_full = FULL_CHUNKS * BLOCK_K  # FULL_CHUNKS = hidden_size // BLOCK_K
    if UNROLLED:
        for c in tl.static_range(FULL_CHUNKS):
            acc_g, acc_u = _gate_up_acc(acc_g, acc_u, g_ptrs + c * BLOCK_K, u_ptrs + c * BLOCK_K,
                                        x_ptrs + c * BLOCK_K)
    else:
        for k0 in range(0, k_full, BLOCK_K):
            acc_g, acc_u = _gate_up_acc(acc_g, acc_u, g_ptrs + k0, u_ptrs + k0, x_ptrs + k0)
    if not EVEN_K:  # the partial last chunk
        kmask = (k_full + kk) < hidden_size
        g = tl.load(g_ptrs + k_full, mask=kmask[None, :, :], other=0.0).to(tl.float32)
        u = tl.load(u_ptrs + k_full, mask=kmask[None, :, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptrs + k_full, mask=kmask, other=0.0).to(tl.float32)[None, :, :]
        acc_g += tl.sum(g * x, axis=2)
        acc_u += tl.sum(u * x, axis=2)

    dtype = act_ptr.dtype.element_ty
    gate = tl.sum(acc_g, axis=1).to(dtype).to(tl.float32)  # F.linear's outputs, in the model dtype
    up = tl.sum(acc_u, axis=1).to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu in the model dtype
    tl.store(act_ptr + a.to(tl.int64) * stride_am + offs_i, (silu * up).to(dtype), mask=imask)


@triton.jit
def _down_acc(acc, w, a_ptrs, mask):
    # acc [BLOCK_E, BLOCK_N, BLOCK_K // VEC] += sum over the thread-local VEC axis of w * act.
    # act [BLOCK_E, 1, BLOCK_K // VEC, VEC]: rows of other ranks' experts are never read (unwritten).
    act = tl.load(a_ptrs, mask=mask, other=0.0)
    return acc + tl.sum(w.to(tl.float32) * act.to(tl.float32), axis=3)


@triton.jit
def _down_kernel(
    act_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr,
    hidden_size, inter_size, expert_start, num_local,
    stride_am, stride_we, stride_wn, stride_om,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    VEC: tl.constexpr, EVEN_K: tl.constexpr, FULL_CHUNKS: tl.constexpr, UNROLLED: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid: (num_tokens, cdiv(H, BLOCK_N)). out[t, n] = sum_j w_j * (act[t*k+j] . w2[e_j, n]).
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < hidden_size
    rows = tl.minimum(offs_n, hidden_size - 1).to(tl.int64)  # rows past H re-read row H-1
    slot = tl.arange(0, BLOCK_E)
    assign = token * TOP_K + slot
    # The routing is not written by stage 1 (see the module docstring): it may be read before the wait.
    expert = tl.load(ids_ptr + assign, mask=slot < TOP_K, other=-1).to(tl.int64) - expert_start
    valid = (slot < TOP_K) & (expert >= 0) & (expert < num_local)
    expert = tl.where(valid, expert, 0)
    weight = tl.load(weights_ptr + assign, mask=valid, other=0.0).to(tl.float32)

    kk = tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    # [BLOCK_E, BLOCK_N, BLOCK_K // VEC, VEC]: every expert's rows n0.. of w2; act rows broadcast over n
    w_ptrs = (w2_ptr + expert[:, None, None, None] * stride_we + rows[None, :, None, None] * stride_wn
              + kk[None, None, :, :])
    a_ptrs = act_ptr + assign.to(tl.int64)[:, None, None, None] * stride_am + kk[None, None, :, :]
    emask = valid[:, None, None, None]

    acc = tl.full([BLOCK_E, BLOCK_N, BLOCK_K // VEC], 0.0, tl.float32)
    k_full = FULL_CHUNKS * BLOCK_K  # FULL_CHUNKS = inter_size // BLOCK_K
    if UNROLLED:
        # Every chunk's w2 loads are independent of the wait (only act is stage 1's): issue them all first.
        for c in tl.static_range(FULL_CHUNKS):
            if c == 0:
                w = tl.load(w_ptrs, mask=emask, other=0.0)
                pdl_wait(PDL)
            else:
                w = tl.load(w_ptrs + c * BLOCK_K, mask=emask, other=0.0)
            acc = _down_acc(acc, w, a_ptrs + c * BLOCK_K, emask)
        if FULL_CHUNKS == 0:
            pdl_wait(PDL)
    else:
        k_start = 0
        if FULL_CHUNKS > 0:  # at least one full chunk: with PDL, it streams in while stage 1 drains
            w_first = tl.load(w_ptrs, mask=emask, other=0.0)
        pdl_wait(PDL)
        if FULL_CHUNKS > 0:
            acc = _down_acc(acc, w_first, a_ptrs, emask)
            k_start = BLOCK_K
        for k0 in range(k_start, k_full, BLOCK_K):
            w = tl.load(w_ptrs + k0, mask=emask, other=0.0)
            acc = _down_acc(acc, w, a_ptrs + k0, emask)
    if not EVEN_K:  # the partial last chunk
        mask = emask & ((k_full + kk) < inter_size)[None, None, :, :]
        w = tl.load(w_ptrs + k_full, mask=mask, other=0.0)
        acc = _down_acc(acc, w, a_ptrs + k_full, mask)

    dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=2).to(dtype).to(tl.float32)  # [BLOCK_E, BLOCK_N]: F.linear's outputs
    y = (y * weight[:, None]).to(dtype).to(tl.float32)  # times the routing weight, in the model dtype
    y = tl.where(valid[:, None], y, 0.0)  # other ranks' experts (and padding slots): exactly zero
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, tl.sum(y, axis=0).to(dtype), mask=nmask)


@triton.jit
def _assignment_acc(acc, w, a_ptrs, mask):
    # acc [BLOCK_N, BLOCK_K // VEC] += sum over the thread-local VEC axis of w * act (act loaded in
    # w's own [BLOCK_N, BLOCK_K // VEC, VEC] shape: each thread its elements, the repeats from L1).
    act = tl.load(a_ptrs, mask=mask, other=0.0)
    return acc + tl.sum(w.to(tl.float32) * act.to(tl.float32), axis=2)


@triton.jit
def _down_per_assignment_kernel(
    act_ptr, w2_ptr, ids_ptr, weights_ptr, part_ptr, arrivals_ptr, out_ptr,
    hidden_size, inter_size, expert_start, num_local,
    stride_am, stride_we, stride_wn, stride_om,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    VEC: tl.constexpr, EVEN_K: tl.constexpr, FULL_CHUNKS: tl.constexpr, UNROLLED: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid: (num_assign, cdiv(H, BLOCK_N)). part[a, n] = w_a * (act[a] . w2[e_a, n]) (rounded as the
    # reference rounds), then out[t, n] = sum_j part[t*k+j, n] by the token's last program to arrive.
    a = tl.program_id(0)
    block = tl.program_id(1)
    token = a // TOP_K
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < hidden_size
    rows = tl.minimum(offs_n, hidden_size - 1).to(tl.int64)  # rows past H re-read row H-1
    local = tl.load(ids_ptr + a).to(tl.int64) - expert_start
    valid = (local >= 0) & (local < num_local)  # another rank's expert: a zero partial, still arriving
    # [BLOCK_N, 1, 1]: nothing is read for a foreign expert (a tensor: the interpreter refuses a scalar mask)
    local_rows = local + 0 * rows[:, None, None]
    emask = (local_rows >= 0) & (local_rows < num_local)
    expert = tl.where(valid, local, 0)
    weight = tl.load(weights_ptr + a).to(tl.float32)
    kk = tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    w_ptrs = w2_ptr + expert * stride_we + rows[:, None, None] * stride_wn + kk[None, :, :]
    a_ptrs = act_ptr + a.to(tl.int64) * stride_am + kk[None, :, :] + 0 * rows[:, None, None]

    acc = tl.full([BLOCK_N, BLOCK_K // VEC], 0.0, tl.float32)
    k_full = FULL_CHUNKS * BLOCK_K  # FULL_CHUNKS = inter_size // BLOCK_K
    if UNROLLED:
        for c in tl.static_range(FULL_CHUNKS):
            w = tl.load(w_ptrs + c * BLOCK_K, mask=emask, other=0.0)
            if c == 0:
                pdl_wait(PDL)  # act is stage 1's; the first chunk of weights streams in meanwhile
            acc = _assignment_acc(acc, w, a_ptrs + c * BLOCK_K, emask)
        if FULL_CHUNKS == 0:
            pdl_wait(PDL)
    else:
        pdl_wait(PDL)
        for k0 in range(0, k_full, BLOCK_K):
            acc = _assignment_acc(acc, tl.load(w_ptrs + k0, mask=emask, other=0.0), a_ptrs + k0, emask)
    if not EVEN_K:  # the partial last chunk
        mask = emask & ((k_full + kk) < inter_size)[None, :, :]
        acc = _assignment_acc(acc, tl.load(w_ptrs + k_full, mask=mask, other=0.0), a_ptrs + k_full, mask)

    dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=1).to(dtype).to(tl.float32)  # [BLOCK_N]: F.linear's outputs
    y = tl.where(valid, (y * weight).to(dtype).to(tl.float32), 0.0)  # times the routing weight, rounded
    tl.store(part_ptr + a.to(tl.int64) * hidden_size + offs_n, y, mask=nmask)
    # Every thread's partial is stored before the program arrives (the barrier), and the release
    # half of the counter's acq_rel publishes them; the last arrival's acquire half sees all k.
    tl.debug_barrier()
    counter = arrivals_ptr + token * tl.num_programs(1) + block
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == TOP_K - 1:
        tl.store(counter, 0)  # the next launch finds it at zero
        slot = tl.arange(0, BLOCK_E)
        p_ptrs = part_ptr + (token * TOP_K + slot).to(tl.int64)[:, None] * hidden_size + offs_n[None, :]
        parts = tl.load(p_ptrs, mask=(slot < TOP_K)[:, None] & nmask[None, :], other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, tl.sum(parts, axis=0).to(dtype), mask=nmask)


def fused_experts_small_batch_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_start: int = 0,
                                     *, config: MoeGemvConfig | None = None) -> torch.Tensor:
    """Same contract as `fused_experts_reference`: hidden [T, H] -> [T, H], always via Triton.
    Meant for T <= MAX_TOKENS (correct for any T). `config` replaces `moe_gemv_config(...)`
    (benchmarks, tests); its block sizes must be powers of two."""
    assert hidden.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, "hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]"
    num_tokens, hidden_size = hidden.shape
    num_local, two_i, _ = w13.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    assert w13.shape == (num_local, 2 * inter_size, hidden_size), (tuple(w13.shape), hidden_size)
    assert w2.shape == (num_local, hidden_size, inter_size), (tuple(w2.shape), tuple(w13.shape))
    assert topk_ids.shape == topk_weights.shape == (num_tokens, top_k), \
        (tuple(topk_ids.shape), tuple(topk_weights.shape))
    assert hidden.dtype == w13.dtype == w2.dtype and hidden.dtype in (torch.bfloat16, torch.float16, torch.float32), \
        (hidden.dtype, w13.dtype, w2.dtype)
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weight rows must be contiguous"
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0 or hidden_size == 0:
        return out
    if top_k == 0 or num_local == 0 or inter_size == 0:
        return out.zero_()
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()  # assignment a = token * k + j

    cfg = config or moe_gemv_config(hidden_size, inter_size, top_k, hidden.dtype)
    assert all(v > 0 and v & (v - 1) == 0 for v in (cfg.block_i, cfg.block_k1, cfg.block_n, cfg.block_k2)), cfg
    act = torch.empty((num_tokens * top_k, inter_size), dtype=hidden.dtype, device=hidden.device)
    launch_gate_up(hidden, w13, ids, act, expert_start, cfg)
    launch_down(act, w2, ids, weights, out, expert_start, cfg)
    return out


def launch_gate_up(hidden, w13, ids, act, expert_start: int, cfg: MoeGemvConfig) -> None:
    """Stage 1 alone (checked inputs, see fused_experts_small_batch_triton): act [T * k, I]."""
    num_local, two_i, hidden_size = w13.shape
    inter_size, top_k = two_i // 2, ids.shape[1]
    grid = (act.shape[0], triton.cdiv(inter_size, cfg.block_i))
    assert grid[1] < 65536, (grid, "a grid's second axis is at most 65535")
    _gate_up_kernel[grid](
        hidden, w13, ids, act,
        hidden_size, inter_size, expert_start, num_local,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_I=cfg.block_i, BLOCK_K=cfg.block_k1, VEC=_vec(hidden.dtype, cfg.block_k1),
        EVEN_K=hidden_size % cfg.block_k1 == 0, FULL_CHUNKS=hidden_size // cfg.block_k1, UNROLLED=cfg.unrolled,
        num_warps=cfg.warps1, **pdl_args(),
    )


def launch_down(act, w2, ids, weights, out, expert_start: int, cfg: MoeGemvConfig) -> None:
    """Stage 2 alone (checked inputs, see fused_experts_small_batch_triton): out [T, H]."""
    num_local, hidden_size, inter_size = w2.shape
    top_k = ids.shape[1]
    if cfg.per_assignment:
        blocks = triton.cdiv(hidden_size, cfg.block_n)
        assert blocks < 65536, (blocks, "a grid's second axis is at most 65535")
        partials = torch.empty((act.shape[0], hidden_size), dtype=torch.float32, device=act.device)
        arrivals = arrival_counters(act.device, out.shape[0] * blocks)
        _down_per_assignment_kernel[(act.shape[0], blocks)](
            act, w2, ids, weights, partials, arrivals, out,
            hidden_size, inter_size, expert_start, num_local,
            act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
            TOP_K=top_k, BLOCK_E=triton.next_power_of_2(top_k), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k2,
            VEC=_vec(act.dtype, cfg.block_k2), EVEN_K=inter_size % cfg.block_k2 == 0,
            FULL_CHUNKS=inter_size // cfg.block_k2, UNROLLED=cfg.unrolled, num_warps=cfg.warps2, **pdl_args(),
        )
        return
    grid = (out.shape[0], triton.cdiv(hidden_size, cfg.block_n))
    assert grid[1] < 65536, (grid, "a grid's second axis is at most 65535")
    _down_kernel[grid](
        act, w2, ids, weights, out,
        hidden_size, inter_size, expert_start, num_local,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_E=triton.next_power_of_2(top_k), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k2,
        VEC=_vec(act.dtype, cfg.block_k2), EVEN_K=inter_size % cfg.block_k2 == 0,
        FULL_CHUNKS=inter_size // cfg.block_k2, UNROLLED=cfg.unrolled,
        num_warps=cfg.warps2, **pdl_args(),
    )
