"""The causal depthwise conv1d in front of the Gated DeltaNet: prefill/extend over a varlen batch,
and the one-token decode step. References: `reference_linear_attention.causal_conv1d[_step]`.

Layout (docs/kernels.md, "Gated DeltaNet kernels"):
  x           [num_tokens, channels] (decode: [num_seqs, channels]); rows may be strided, channels
              contiguous (the mixed q/k/v slice of the input projection's output)
  weight      [channels, width] with contiguous rows, width 2..4; bias [channels] or None
  conv_state  [num_slots, channels, width - 1], any strides: the last width - 1 inputs of a request
              (stored channels-contiguous, its accesses are 16-byte vectors like x's)
  out         new [num_tokens, channels] tensor in x's dtype
Sequence i owns rows query_start_loc[i]..query_start_loc[i + 1] and its state lives in slot
state_slots[i]; without has_initial_state[i] its history is zeros whatever the slot holds. Every
sequence's state is updated in place to its last width - 1 inputs (a sequence shorter than that
keeps the tail of its history). The decode step treats a negative slot as a padding row: its
state is neither read nor written and its output row is zero (the reference, which indexes from
the end, must not be given one).

Rounding follows the reference: inputs and history in the weight's dtype, products and sums in
fp32, the conv output (bias included) rounded once to the weight's dtype, SiLU in fp32, the result
rounded to x's dtype; states store the weight-dtype inputs in the state's dtype.
"""

from __future__ import annotations

import torch

from metrale.kernels import pdl_args, pdl_wait, tl, triton, use_triton
from metrale.kernels import reference_linear_attention as ref

BLOCK_T = 64  # tokens per prefill program: the gated delta rule's chunk, so both can share `varlen_blocks`


def varlen_blocks(query_start_loc: torch.Tensor, query_start_cpu: list[int] | None, block: int):
    """Cuts every sequence into blocks of `block` rows (its last block partial) for a kernel with
    one program per block. -> (blocks int32 [num_blocks, 2]: (sequence, first row) of each block;
    first_block int32 [num_seqs + 1]: sequence i owns blocks first_block[i]..first_block[i + 1];
    num_blocks). Built on the host from `query_start_cpu` (read from query_start_loc, a host
    sync, when it is None) and copied in one non-blocking transfer."""
    starts = query_start_loc.tolist() if query_start_cpu is None else list(query_start_cpu)
    assert len(starts) == query_start_loc.numel(), (len(starts), query_start_loc.shape)
    table, first = [], [0]
    for i in range(len(starts) - 1):
        for t0 in range(starts[i], starts[i + 1], block):
            table += (i, t0)
        first.append(len(table) // 2)
    num_blocks = len(table) // 2
    # first_block starts 16-byte aligned: Triton compiles a variant per pointer alignment, and an
    # offset that changed with the block count would recompile the kernels mid-serving.
    offset = -(-2 * num_blocks // 4) * 4
    host = torch.tensor(table + [0] * (offset - len(table)) + first, dtype=torch.int32)
    device = query_start_loc.device
    if device.type == "cuda":  # pinned, so the copy is asynchronous (the caching host allocator
        host = host.pin_memory()  # keeps the buffer until the copy has run)
    packed = host.to(device, non_blocking=True)
    return packed[:2 * num_blocks].view(num_blocks, 2), packed[offset:], num_blocks


@triton.jit
def _silu_out(acc, w_dtype: tl.constexpr, SILU: tl.constexpr):
    # The reference's roundings: the conv output to the weight's dtype, then SiLU in fp32.
    y = acc.to(w_dtype).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    return y


@triton.jit
def _input(x_ptr, state_c, src, start, hist_lo, stride_x, stride_sw, c, channels, KW: tl.constexpr,
           w_dtype: tl.constexpr):
    # Input row `src` of the sequence that starts at row `start`, in the weight's dtype: x's row
    # inside the sequence, else history position hp = KW-1 + src - start, which exists iff
    # hp >= hist_lo (zeros otherwise). The row conditions are bounds on c rather than scalar
    # masks, which the interpreter mistypes.
    hp = KW - 1 + src - start
    x_lim = tl.where(src >= start, channels, 0)
    h_lim = tl.where(src < start, tl.where(hp >= hist_lo, channels, 0), 0)
    xr = tl.load(x_ptr + src.to(tl.int64) * stride_x + c, mask=c < x_lim, other=0.0)
    hr = tl.load(state_c + hp * stride_sw, mask=c < h_lim, other=0.0)
    return tl.where(src >= start, xr.to(w_dtype), hr.to(w_dtype))


@triton.jit
def _tap(w_ptr, c, cmask, stride_w, lag: tl.constexpr, KW: tl.constexpr):
    # The weight of the input `lag` rows back (tap KW-1-lag), zero past the kernel's width.
    if lag < KW:
        return tl.load(w_ptr + c * stride_w + (KW - 1 - lag), mask=cmask, other=0.0).to(tl.float32)
    return tl.zeros(c.shape, dtype=tl.float32)


@triton.jit
def _weights(w_ptr, bias_ptr, c, cmask, stride_w, KW: tl.constexpr, HAS_BIAS: tl.constexpr):
    # The four taps (by lag) and the bias of channels c, in fp32 (zeros past the width / no bias).
    bias = tl.zeros(c.shape, dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    return (_tap(w_ptr, c, cmask, stride_w, 0, KW), _tap(w_ptr, c, cmask, stride_w, 1, KW),
            _tap(w_ptr, c, cmask, stride_w, 2, KW), _tap(w_ptr, c, cmask, stride_w, 3, KW), bias)


@triton.jit
def _conv1d_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, qsl_ptr, blocks_ptr, slots_ptr, has_state_ptr,
    channels, stride_x, stride_out, stride_w, stride_ss, stride_sc, stride_sw,
    KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # grid (num_blocks, cdiv(channels, BLOCK_C)): rows t0..t0+BLOCK_T-1 of one sequence, one block
    # of channels. The rows are walked in order with the last KW-1 inputs kept in registers
    # (x1, x2, x3: one, two, three rows back), so every input row is read once. KW <= 4.
    seq = tl.load(blocks_ptr + 2 * tl.program_id(0))
    t0 = tl.load(blocks_ptr + 2 * tl.program_id(0) + 1)
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    # history positions hp >= hist_lo exist: all KW-1 of them with a state, none without
    hist_lo = (KW - 1) * (1 - (tl.load(has_state_ptr + seq) != 0).to(tl.int32))
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < channels
    w_dtype: tl.constexpr = w_ptr.dtype.element_ty
    state_c = state_ptr + slot * stride_ss + c * stride_sc
    w0, w1, w2, w3, bias = _weights(w_ptr, bias_ptr, c, cmask, stride_w, KW, HAS_BIAS)

    # Only a sequence's first block reaches before its start (BLOCK_T >= KW - 1).
    x1 = _input(x_ptr, state_c, t0 - 1, start, hist_lo, stride_x, stride_sw, c, channels, KW, w_dtype)
    x2 = _input(x_ptr, state_c, t0 - 2, start, hist_lo, stride_x, stride_sw, c, channels, KW, w_dtype)
    x3 = _input(x_ptr, state_c, t0 - 3, start, hist_lo, stride_x, stride_sw, c, channels, KW, w_dtype)
    for r in tl.static_range(BLOCK_T):
        lim = tl.where(t0 + r < end, channels, 0)
        row = (t0 + r).to(tl.int64)
        x0 = tl.load(x_ptr + row * stride_x + c, mask=c < lim, other=0.0).to(w_dtype)
        acc = bias + x3.to(tl.float32) * w3 + x2.to(tl.float32) * w2 + x1.to(tl.float32) * w1 + x0.to(tl.float32) * w0
        tl.store(out_ptr + row * stride_out + c, _silu_out(acc, w_dtype, SILU).to(out_ptr.dtype.element_ty),
                 mask=c < lim)
        x3, x2, x1 = x2, x1, x0

    if t0 == start:
        # The first block's program is the only one that reads this sequence's state, so it also
        # writes the new one: position p gets input end - (KW-1) + p, an input row or (for a
        # sequence shorter than KW-1) the old history.
        n0 = _input(x_ptr, state_c, end - (KW - 1), start, hist_lo, stride_x, stride_sw, c, channels, KW, w_dtype)
        n1 = n0
        n2 = n0
        if KW >= 3:
            n1 = _input(x_ptr, state_c, end - (KW - 2), start, hist_lo, stride_x, stride_sw, c, channels, KW, w_dtype)
        if KW >= 4:
            n2 = _input(x_ptr, state_c, end - (KW - 3), start, hist_lo, stride_x, stride_sw, c, channels, KW, w_dtype)
        # Other threads may still be reading the old history at these addresses (above, and for
        # x1..x3): every read completes before any thread overwrites it.
        tl.debug_barrier()
        st_dtype: tl.constexpr = state_ptr.dtype.element_ty
        tl.store(state_c, n0.to(st_dtype), mask=cmask)
        if KW >= 3:
            tl.store(state_c + stride_sw, n1.to(st_dtype), mask=cmask)
        if KW >= 4:
            tl.store(state_c + 2 * stride_sw, n2.to(st_dtype), mask=cmask)


@triton.jit
def _history(state_c, lag: tl.constexpr, stride_sw, cmask, KW: tl.constexpr, w_dtype: tl.constexpr):
    # The saved input `lag` rows back (state position KW-1-lag), zeros past the kernel's width.
    if lag < KW:
        return tl.load(state_c + (KW - 1 - lag) * stride_sw, mask=cmask, other=0.0).to(w_dtype)
    return tl.zeros(cmask.shape, dtype=w_dtype)


@triton.jit
def _conv1d_step_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, slots_ptr,
    channels, stride_x, stride_out, stride_w, stride_ss, stride_sc, stride_sw,
    KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    # grid (num_seqs, cdiv(channels, BLOCK_C)). The saved inputs h1, h2, h3 (one, two, three rows
    # back) and the new one make the window; the new state drops the oldest. The weights are
    # read before waiting for the previous kernel (PDL), everything else after. KW <= 4.
    n = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < channels
    w0, w1, w2, w3, bias = _weights(w_ptr, bias_ptr, c, cmask, stride_w, KW, HAS_BIAS)
    pdl_wait(PDL)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    out_ptrs = out_ptr + n.to(tl.int64) * stride_out + c
    if slot < 0:  # a padding row
        tl.store(out_ptrs, tl.zeros([BLOCK_C], dtype=out_ptr.dtype.element_ty), mask=cmask)
        return
    w_dtype: tl.constexpr = w_ptr.dtype.element_ty
    state_c = state_ptr + slot * stride_ss + c * stride_sc
    h1 = _history(state_c, 1, stride_sw, cmask, KW, w_dtype)
    h2 = _history(state_c, 2, stride_sw, cmask, KW, w_dtype)
    h3 = _history(state_c, 3, stride_sw, cmask, KW, w_dtype)
    x = tl.load(x_ptr + n.to(tl.int64) * stride_x + c, mask=cmask, other=0.0).to(w_dtype)
    acc = bias + h3.to(tl.float32) * w3 + h2.to(tl.float32) * w2 + h1.to(tl.float32) * w1 + x.to(tl.float32) * w0
    tl.store(out_ptrs, _silu_out(acc, w_dtype, SILU).to(out_ptr.dtype.element_ty), mask=cmask)
    # Every position moves one back, into an address another thread may still be reading.
    tl.debug_barrier()
    st_dtype: tl.constexpr = state_ptr.dtype.element_ty
    tl.store(state_c + (KW - 2) * stride_sw, x.to(st_dtype), mask=cmask)
    if KW >= 3:
        tl.store(state_c + (KW - 3) * stride_sw, h1.to(st_dtype), mask=cmask)
    if KW >= 4:
        tl.store(state_c + (KW - 4) * stride_sw, h2.to(st_dtype), mask=cmask)


def _check(x, weight, bias, conv_state):
    channels, width = weight.shape
    assert x.dim() == 2 and x.shape[1] == channels and x.stride(1) == 1, "x [rows, channels], channels contiguous"
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    assert 2 <= width <= 4, width
    assert conv_state.dim() == 3 and conv_state.shape[1:] == (channels, width - 1), conv_state.shape
    assert bias is None or bias.shape == (channels,), bias.shape
    return channels, width


def _block_c(channels: int) -> int:
    return min(1024, max(32, triton.next_power_of_2(channels)))


def causal_conv1d_triton(x, weight, bias, conv_state, query_start_loc, state_slots, has_initial_state,
                         silu: bool = True, query_start_cpu: list[int] | None = None) -> torch.Tensor:
    """Triton path of `causal_conv1d` (conv_state updated in place)."""
    channels, width = _check(x, weight, bias, conv_state)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    blocks, _, num_blocks = varlen_blocks(query_start_loc, query_start_cpu, BLOCK_T)
    if num_blocks == 0:
        return out
    block_c = _block_c(channels)
    _conv1d_varlen_kernel[(num_blocks, triton.cdiv(channels, block_c))](
        x, weight, bias if bias is not None else weight, conv_state, out, query_start_loc, blocks, state_slots,
        has_initial_state, channels, x.stride(0), out.stride(0), weight.stride(0), *conv_state.stride(),
        KW=width, HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=BLOCK_T, BLOCK_C=block_c, num_warps=4,
    )
    return out


def causal_conv1d_step_triton(x, weight, bias, conv_state, state_slots, silu: bool = True) -> torch.Tensor:
    """Triton path of `causal_conv1d_step` (conv_state updated in place; slot < 0: padding row)."""
    channels, width = _check(x, weight, bias, conv_state)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block_c = _block_c(channels)
    _conv1d_step_kernel[(x.shape[0], triton.cdiv(channels, block_c))](
        x, weight, bias if bias is not None else weight, conv_state, out, state_slots,
        channels, x.stride(0), out.stride(0), weight.stride(0), *conv_state.stride(),
        KW=width, HAS_BIAS=bias is not None, SILU=silu, BLOCK_C=block_c, num_warps=4, **pdl_args(),
    )
    return out


def causal_conv1d(x, weight, bias, conv_state, query_start_loc, state_slots, has_initial_state,
                  silu: bool = True, query_start_cpu: list[int] | None = None) -> torch.Tensor:
    """Depthwise causal conv over each sequence of a varlen batch, preceded by its saved inputs
    (zeros for a fresh sequence); conv_state updated in place. [num_tokens, channels] in x's dtype."""
    if use_triton(x):
        return causal_conv1d_triton(x, weight, bias, conv_state, query_start_loc, state_slots, has_initial_state,
                                    silu, query_start_cpu)
    return ref.causal_conv1d(x, weight, bias, conv_state, query_start_loc, state_slots, has_initial_state, silu)


def causal_conv1d_step(x, weight, bias, conv_state, state_slots, silu: bool = True) -> torch.Tensor:
    """One new token per sequence (decode): x [num_seqs, channels]; conv_state updated in place."""
    if use_triton(x):
        return causal_conv1d_step_triton(x, weight, bias, conv_state, state_slots, silu)
    return ref.causal_conv1d_step(x, weight, bias, conv_state, state_slots, silu)
