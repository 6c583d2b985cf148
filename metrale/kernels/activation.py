"""SwiGLU gate: silu_and_mul(x [..., 2d]) -> silu(x[..., :d]) * x[..., d:]  ([..., d]).

Rounding matches HF's `act_fn(gate) * up` in the model dtype: silu is computed
in fp32 and rounded to the model dtype, then the product is computed exactly
in fp32 and rounded once more.
"""

from __future__ import annotations

import torch

from metrale.kernels import pdl_args, pdl_launch_dependents, pdl_wait, reference, tl, triton, use_triton


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)  # the down GEMV after it prefetches its weights meanwhile
    # grid: (rows, cdiv(d, BLOCK)); gate = x[row, :d], up = x[row, d:2d].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.shape[-1] % 2 == 0 and x.stride(-1) == 1
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and d > 0:
        block = min(triton.next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=4, **pdl_args())
    return out.view(*x.shape[:-1], d)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] -> [..., d] (new tensor)."""
    return silu_and_mul_triton(x) if use_triton(x) else reference.silu_and_mul(x)
