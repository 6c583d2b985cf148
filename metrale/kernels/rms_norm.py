"""RMSNorm and fused residual-add + RMSNorm, with HF LlamaRMSNorm's rounding.

HF order of casts (reproduced exactly; only the fp32 sum order differs):
    h = x.float(); h = h * rsqrt(mean(h^2) + eps); out = weight * h.to(x.dtype)
`weight * ...` is a product of two model-dtype values; it is computed exactly in
fp32 and rounded once, which is what torch does for bf16/fp16 products.
For the fused variant, new_residual = x + residual is rounded to the model dtype
BEFORE normalising (as HF does: `hidden = residual + hidden` in model dtype).
Outputs have x's dtype. Both functions return new tensors (inputs untouched).

Zero-centred variant (Qwen3-Next, Qwen3.5, Gemma: the weight is stored as w - 1), with its
reference's rounding: out = (h * rstd * (1 + weight.float())).to(dtype), no intermediate cast.

Gated variant (the output norm of Gated DeltaNet layers), per head of dim D:
    out = ((weight * (h * rstd).to(dtype)) * silu(gate.float())).to(dtype)
where the weight product is rounded to the model dtype before the gate multiplies it.
"""

from __future__ import annotations

import torch

from metrale.kernels import pdl_args, pdl_wait, reference, tl, triton, use_triton


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    # One program per row; the whole row fits in one BLOCK (BLOCK >= hidden). The weight, which
    # no kernel writes, is loaded before waiting for the previous kernel (PDL).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded like HF
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    if ZERO_CENTRED:
        out = h * rstd * (1.0 + w)
    else:
        out = w * (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF casts back before * weight
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, stride_x, stride_gate, stride_out, heads, dim, eps,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
    # One program per (row, head): x and gate rows may be strided, each head contiguous.
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + head * dim + cols, mask=mask, other=0.0)
    g = tl.load(gate_ptr + row * stride_gate + head * dim + cols, mask=mask, other=0.0).to(tl.float32)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / dim + eps)
    dtype = out_ptr.dtype.element_ty
    weighted = (w * (h * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out = weighted * (g * tl.sigmoid(g))
    tl.store(out_ptr + row * stride_out + head * dim + cols, out.to(dtype), mask=mask)


def _launch(x, residual, weight, eps, zero_centred: bool = False):
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and x.stride(-1) == 1
    x2 = x.reshape(-1, hidden)  # a view when possible; rows may be strided
    rows = x2.shape[0]
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        r2 = residual.reshape(-1, hidden)
        assert r2.stride(-1) == 1
        res_out = torch.empty_like(out)
    else:
        r2, res_out = x2, out  # unused
    if rows > 0:
        block = triton.next_power_of_2(hidden)
        num_warps = min(max(block // 256, 1), 16)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, ZERO_CENTRED=zero_centred, BLOCK=block, num_warps=num_warps,
            **pdl_args(),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def rms_norm_triton(x, weight, eps, zero_centred: bool = False):
    return _launch(x, None, weight, eps, zero_centred)


def fused_add_rms_norm_triton(x, residual, weight, eps, zero_centred: bool = False):
    return _launch(x, residual, weight, eps, zero_centred)


def gated_rms_norm_triton(x, gate, weight, eps):
    """x, gate [rows, heads * dim] (rows may be strided, heads contiguous), weight [dim]."""
    dim = weight.shape[0]
    heads = x.shape[-1] // dim
    assert x.stride(-1) == 1 and gate.stride(-1) == 1 and gate.shape == x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] > 0:
        block = triton.next_power_of_2(dim)
        _gated_rms_norm_kernel[(x.shape[0], heads)](x, gate, weight, out, x.stride(0), gate.stride(0), out.stride(0),
                                                    heads, dim, eps, BLOCK=block, num_warps=max(1, block // 256),
                                                    **pdl_args())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> rmsnorm(x) * weight, same shape and dtype as x."""
    return rms_norm_triton(x, weight, eps) if use_triton(x) else reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    """-> (normed, new_residual) with new_residual = x + residual, normed = rms_norm(new_residual)."""
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)
