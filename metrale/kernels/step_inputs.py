"""A step's inputs completed on the device from the step before it, in one launch.

Under asynchronous scheduling step N+1 is uploaded before step N's results reach the host
(executor/last_step.py says what the host leaves open). This fixes the uploaded tensors in place:

- token holes: input_ids[token_holes[i]] = tokens[token_sources[i]] (a token step N sampled);
- draft holes: input_ids[draft_holes[i]] = max(drafts[draft_sources[i]], 0) (a draft step N's
  drafter proposed; -1, a short draft, is never planned and is clamped to a valid id anyway);
- moved sequences (planned over step N's drafts as if all were accepted): with
  delta_s = accepted[moved_last_rows[s]] - moved_unverified[s] (<= 0), each of the sequence's
  rows r = moved_rows[i] (sequence s = moved_row_seqs[i]) moves back, positions[r] += delta_s and
  slots[r] = tables[moved_seqs[s], p // block_size] * block_size + p % block_size for its new
  position p, and seq_lens[moved_seqs[s]] += delta_s.

Every index written is written once (holes, rows and sequences are distinct), so the order of
the writes does not matter. `fill_step_inputs` dispatches: one Triton program for CUDA tensors
(the index arrays are a step's decode rows: a few loop iterations), the PyTorch reference
(kernels/reference.py), about twenty small launches on a GPU, otherwise.
"""

from __future__ import annotations

import torch

from metrale.kernels import reference, tl, triton, use_triton

# Counts and strides change from step to step: not specialised on, so that one variant serves
# every step. Pointers are (16-byte alignment): the upload's arrays and fresh tensors always are
# aligned, and `accepted`, a row of a verify graph's verdict, is at an 8-byte offset for odd batch
# sizes; kernel_warmup.py compiles both variants.
@triton.jit
def _fill_holes(input_ids_ptr, values_ptr, holes_ptr, sources_ptr, count, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    # input_ids[holes[i]] = values[sources[i]] (at least 0 where CLAMP) for i < count.
    offs = tl.arange(0, BLOCK)
    for start in range(0, count, BLOCK):
        i = start + offs
        m = i < count
        hole = tl.load(holes_ptr + i, mask=m, other=0)
        value = tl.load(values_ptr + tl.load(sources_ptr + i, mask=m, other=0), mask=m)
        if CLAMP:
            value = tl.maximum(value, 0)
        tl.store(input_ids_ptr + hole, value, mask=m)


@triton.jit
def _moved_by(accepted_ptr, moved_last_rows_ptr, moved_unverified_ptr, s, m):
    # delta_s of moved sequence s (module docstring): what its last step rejected, negated.
    return (tl.load(accepted_ptr + tl.load(moved_last_rows_ptr + s, mask=m, other=0), mask=m, other=0)
            - tl.load(moved_unverified_ptr + s, mask=m, other=0))


# Counts and strides change from step to step: not specialised on, so that one variant serves
# every step. Pointers are (16-byte alignment): the upload's arrays and fresh tensors always are
# aligned, and `accepted`, a row of a verify graph's verdict, is at an 8-byte offset for odd batch
# sizes; kernel_warmup.py compiles both variants.
@triton.jit(do_not_specialize=["stride_t", "block_size", "num_tokens", "num_drafts", "num_moved", "num_moved_rows"])
def _fill_kernel(input_ids_ptr, positions_ptr, slots_ptr, seq_lens_ptr, tables_ptr, stride_t, block_size,
                 tokens_ptr, token_holes_ptr, token_sources_ptr, num_tokens,
                 drafts_ptr, draft_holes_ptr, draft_sources_ptr, num_drafts,
                 accepted_ptr, moved_seqs_ptr, moved_unverified_ptr, moved_last_rows_ptr, num_moved,
                 moved_rows_ptr, moved_row_seqs_ptr, num_moved_rows, BLOCK: tl.constexpr):
    _fill_holes(input_ids_ptr, tokens_ptr, token_holes_ptr, token_sources_ptr, num_tokens, False, BLOCK)
    _fill_holes(input_ids_ptr, drafts_ptr, draft_holes_ptr, draft_sources_ptr, num_drafts, True, BLOCK)
    offs = tl.arange(0, BLOCK)
    for start in range(0, num_moved_rows, BLOCK):
        i = start + offs
        m = i < num_moved_rows
        row = tl.load(moved_rows_ptr + i, mask=m, other=0)
        s = tl.load(moved_row_seqs_ptr + i, mask=m, other=0)
        position = tl.load(positions_ptr + row, mask=m, other=0) + _moved_by(
            accepted_ptr, moved_last_rows_ptr, moved_unverified_ptr, s, m)
        tl.store(positions_ptr + row, position, mask=m)
        seq = tl.load(moved_seqs_ptr + s, mask=m, other=0).to(tl.int64)
        block = tl.load(tables_ptr + seq * stride_t + position // block_size, mask=m, other=0).to(tl.int64)
        tl.store(slots_ptr + row, block * block_size + position % block_size, mask=m)
    for start in range(0, num_moved, BLOCK):
        i = start + offs
        m = i < num_moved
        seq = tl.load(moved_seqs_ptr + i, mask=m, other=0)
        delta = _moved_by(accepted_ptr, moved_last_rows_ptr, moved_unverified_ptr, i, m)
        length = tl.load(seq_lens_ptr + seq, mask=m, other=0)
        tl.store(seq_lens_ptr + seq, length + delta.to(length.dtype), mask=m)


def fill_step_inputs_triton(input_ids, positions, slots, seq_lens, tables, block_size: int,
                            tokens=None, token_holes=None, token_sources=None,
                            drafts=None, draft_holes=None, draft_sources=None,
                            accepted=None, moved_seqs=None, moved_unverified=None, moved_last_rows=None,
                            moved_rows=None, moved_row_seqs=None, block: int = 1024) -> None:
    """`fill_step_inputs` in one Triton program. Index arrays int64; tokens, drafts, accepted,
    input_ids, positions and slots int64; seq_lens and tables int32 (the runner's upload)."""
    def n(t):
        return 0 if t is None else t.numel()

    def ptr(t):  # an absent array is never read (its count is 0): any tensor of the step will do
        return input_ids if t is None else t

    _fill_kernel[(1,)](
        input_ids, positions, slots, seq_lens, tables, tables.stride(0), block_size,
        ptr(tokens), ptr(token_holes), ptr(token_sources), n(token_holes),
        ptr(drafts), ptr(draft_holes), ptr(draft_sources), n(draft_holes),
        ptr(accepted), ptr(moved_seqs), ptr(moved_unverified), ptr(moved_last_rows), n(moved_seqs),
        ptr(moved_rows), ptr(moved_row_seqs), n(moved_rows), BLOCK=block,
    )


def fill_step_inputs(input_ids, positions, slots, seq_lens, tables, block_size: int, **sources) -> None:
    """Complete a step's uploaded inputs in place from the last step's tokens, drafts and
    accepted counts (the module docstring), per the index arrays in `sources` (absent: none)."""
    fill = fill_step_inputs_triton if use_triton(input_ids) else reference.fill_step_inputs
    fill(input_ids, positions, slots, seq_lens, tables, block_size, **sources)
