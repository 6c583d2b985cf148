"""The token bitmask of structured outputs, applied to the logits in place: one Triton launch.

Row i of the bitmask (int32 words, bit j of word w = token 32 * w + j, xgrammar's layout)
masks logits row rows[i]: a token whose bit is 0 gets -inf. Only masked entries are written,
and no [rows, vocab] intermediate exists, so a 256-row batch over a 152K vocabulary costs
nothing beyond reading the bitmask (4.6 MiB) and the writes. The PyTorch reference is
reference.apply_token_bitmask.
"""

from __future__ import annotations

import torch

from metrale.kernels import reference, tl, triton, use_triton

BLOCK_V = 1024
# The number of constrained rows changes every step, and the widths with the vocabulary: no
# kernel variant per value of them.
NO_SPECIALIZE = ["n_rows", "vocab", "words", "stride_row"]


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, n_rows, vocab, words, stride_row,
                          BLOCK_V: tl.constexpr):
    i = tl.program_id(0)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = v < vocab
    word = tl.load(bitmask_ptr + i.to(tl.int64) * words + v // 32, mask=in_vocab & (v // 32 < words), other=0)
    banned = in_vocab & (((word >> (v % 32)) & 1) == 0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    tl.store(logits_ptr + row * stride_row + v, tl.full([BLOCK_V], float("-inf"), tl.float32)
             .to(logits_ptr.dtype.element_ty), mask=banned)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    assert logits.stride(1) == 1 and bitmask.is_contiguous() and bitmask.dtype == torch.int32
    n_rows, vocab = rows.shape[0], logits.shape[1]
    if n_rows == 0:
        return
    grid = (n_rows, triton.cdiv(vocab, BLOCK_V))
    _apply_bitmask_kernel[grid](logits, bitmask, rows, n_rows, vocab, bitmask.shape[1], logits.stride(0),
                                BLOCK_V=BLOCK_V)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: tokens a row's grammar does not allow now get -inf (rows: int64 row indices)."""
    if use_triton(logits):
        apply_token_bitmask_triton(logits, bitmask, rows)
    else:
        reference.apply_token_bitmask(logits, bitmask, rows)
