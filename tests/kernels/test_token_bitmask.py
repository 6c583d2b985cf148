"""The token-bitmask kernel against its PyTorch reference."""

import pytest
import torch

from metrale.kernels import reference
from metrale.kernels.token_bitmask import apply_token_bitmask_triton


def _case(n_logit_rows, rows, vocab, words, seed, dtype, device):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_logit_rows, vocab, generator=g).to(dtype).to(device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32).to(device)
    return logits, bitmask, torch.tensor(rows, dtype=torch.int64, device=device)


@pytest.mark.parametrize("vocab,words", [(384, 12), (100, 4), (1030, 33), (70, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(vocab, words, dtype, device):
    logits, bitmask, rows = _case(5, [3, 0, 4], vocab, words, vocab + words, dtype, device)
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask, rows)
    apply_token_bitmask_triton(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    untouched = [1, 2]
    assert torch.isfinite(logits[untouched]).all()


def test_reference_bit_layout():
    logits = torch.zeros(1, 40)
    bitmask = torch.tensor([[0b101, 1 << 3]], dtype=torch.int32)  # tokens 0, 2 and 35
    reference.apply_token_bitmask(logits, bitmask, torch.tensor([0]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2, 35]
    top = torch.tensor([[-2**31]], dtype=torch.int32)  # bit 31 only: token 31
    logits = torch.zeros(1, 32)
    reference.apply_token_bitmask(logits, top, torch.tensor([0]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31]
