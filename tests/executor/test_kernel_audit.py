"""The kernel audit (phase 7) and `met serve --check-kernels` (issue 20), on the CPU through
Triton's interpreter: every variant the forward launches is listed, and one that cannot be built
fails startup naming it (exit status: the unresolved count)."""

from __future__ import annotations

import pytest

from metrale.entrypoints.cli import main
from metrale.kernels import HAS_TRITON, interpret_mode, tl, triton

pytestmark = pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs triton's CPU interpreter")


@triton.jit
def _unbuildable_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                                 stride_res_out, hidden, eps, HAS_RESIDUAL: tl.constexpr, ZERO_CENTRED: tl.constexpr,
                                 BLOCK: tl.constexpr, PDL: tl.constexpr):
    tl.static_assert(BLOCK < 0, "this variant cannot be built (on purpose)")


def _check(path, capsys) -> tuple[int, str]:
    code = main(["serve", "--check-kernels", "--model", path, "--device", "cpu", "--dtype", "float32",
                 "--num-kv-blocks", "16", "--max-num-seqs", "4"])
    return code, capsys.readouterr().out


def test_check_kernels_lists_every_variant_and_exits_0(checkpoint_factory, capsys):
    code, out = _check(checkpoint_factory("llama"), capsys)
    assert code == 0, out
    for kernel in ("rms_norm._rms_norm_kernel", "paged_attention._extend_kernel", "paged_attention._decode_kernel",
                   "gemv._gemv_kernel", "activation._silu_and_mul_kernel"):
        assert kernel in out, kernel
    assert "interpreted" in out and "unresolved" not in out
    assert "HAS_RESIDUAL=" in out or "dtypes=float32" in out  # the variant column


def test_an_unbuildable_variant_is_named_and_counted(checkpoint_factory, capsys, monkeypatch):
    import metrale.kernels.rms_norm as rms_norm

    monkeypatch.setattr(rms_norm, "_rms_norm_kernel", _unbuildable_rms_norm_kernel)
    code, out = _check(checkpoint_factory("llama"), capsys)
    assert code >= 1, out
    assert "_unbuildable_rms_norm_kernel" in out and "unresolved" in out and "cannot be built" in out


def test_startup_fails_on_an_unbuildable_variant_naming_it(checkpoint_factory, monkeypatch):
    import metrale.kernels.rms_norm as rms_norm
    from metrale import LLM
    from metrale.executor.kernel_audit import KernelBuildError

    monkeypatch.setattr(rms_norm, "_rms_norm_kernel", _unbuildable_rms_norm_kernel)
    with pytest.raises(KernelBuildError, match="_unbuildable_rms_norm_kernel"):
        LLM(checkpoint_factory("llama"), device="cpu", dtype="float32", forward="eager", num_kv_blocks=16)
