"""Compile kernels for an H100/H200 (sm_90) ahead of time, with no GPU: Triton's bundled ptxas
turns each into a cubin, so errors that only GPU compilation raises (the interpreter runs the
Python semantics) show up on the CPU. Prints one line per kernel (registers, local memory) and
exits 1 if any fails. Run with TRITON_INTERPRET unset (the test does):

    python tests/kernels/compile_sm90.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from metrale.kernels import gemv as G
from metrale.kernels import sampling as S

F32, I64, I32, INT = "*fp32", "*i64", "*i32", "i32"
_TILE = {"n_rows": INT, "vocab": INT, "stride_row": INT, "num_chunks": INT, "eps": "fp32"}

# name: (kernel, argument types, constexprs, num_warps): the launch shapes of a Qwen3 vocabulary
KERNELS = {
    "sampling._chunk_max_kernel": (S._chunk_max_kernel, {"logits_ptr": F32, "chunk_max_ptr": F32, "temp_ptr": F32,
                                                         **_TILE}, {"ROWS": 1, "BLOCK_V": 4096}, 8),
    **{f"sampling._radix_count_kernel[MASS={mass}]": (
        S._radix_count_kernel, {"logits_ptr": F32, "hist_ptr": I64, "prefix_ptr": I64, "need_ptr": I64,
                                "floor_ptr": I64, "chunk_max_ptr": F32, "temp_ptr": F32, **_TILE},
        {"SHIFT": 8, "MASS": mass, "ROWS": 1, "BLOCK_V": 4096, "CHUNKS": 64}, 8) for mass in (False, True)},
    "sampling._radix_pick_kernel": (S._radix_pick_kernel, {"hist_ptr": I64, "prefix_ptr": I64, "need_ptr": I64,
                                                           "n_rows": INT}, {"ROWS": 1}, 4),
    "sampling._mass_kernel": (S._mass_kernel, {"logits_ptr": F32, "z_ptr": I64, "floor_ptr": I64, "on_ptr": I32,
                                               "chunk_max_ptr": F32, "temp_ptr": F32, **_TILE},
                              {"ROWS": 1, "BLOCK_V": 4096, "CHUNKS": 64}, 8),
    "sampling._chunk_draw_kernel": (S._chunk_draw_kernel, {
        "logits_ptr": F32, "chunk_max_ptr": F32, "thr_ptr": I64, "chunk_best_ptr": F32, "chunk_idx_ptr": I64,
        "temp_ptr": F32, "min_p_ptr": F32, "seed_ptr": I64, "offset_ptr": I64, **_TILE},
        {"ROWS": 1, "BLOCK_V": 4096, "CHUNKS": 64, "USE_MIN_P": True, "USE_THRESHOLD": True}, 8),
    "sampling._pick_chunk_kernel": (S._pick_chunk_kernel, {"chunk_best_ptr": F32, "chunk_idx_ptr": I64,
                                                           "out_ptr": I64, "n_rows": INT, "num_chunks": INT},
                                    {"ROWS": 1, "CHUNKS": 64}, 1),
    "sampling._row_sample_kernel": (S._row_sample_kernel, {
        "logits_ptr": F32, "out_ptr": I64, "temp_ptr": F32, "top_k_ptr": I64, "top_p_ptr": F32, "min_p_ptr": F32,
        "seed_ptr": I64, "offset_ptr": I64, "n_rows": INT, "vocab": INT, "stride_row": INT, "eps": "fp32"},
        {"ROWS": 1, "BLOCK_V": 4096}, 8),
    "gemv._gemv_kernel[M=1]": (G._gemv_kernel, {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "N": INT, "K": INT,
        "stride_xm": INT, "stride_wn": INT, "stride_ym": INT},
        {"M": 1, "HAS_BIAS": False, "EVEN_K": True, "BLOCK_N": 4, "BLOCK_K": 1024, "VEC": 8, "NUM_STAGES": 1}, 4),
}


def resource_usage(cubin: bytes, name: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"met_{os.getpid()}_{abs(hash(name))}.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, timeout=60).stdout
    finally:
        os.remove(path)
    return next((line.split("Resource usage:")[-1].strip() for line in out.splitlines() if "REG:" in line), "?")


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    target, failed = GPUTarget("cuda", 90, 32), []
    for name, (kernel, types, constexprs, num_warps) in KERNELS.items():
        signature = dict(types, **{k: "constexpr" for k in constexprs})
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target,
                                      options={"num_warps": num_warps})
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failed.append(name)
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}")
            continue
        print(f"{name}: {resource_usage(compiled.asm['cubin'], name)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
