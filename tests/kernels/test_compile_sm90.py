"""The newest kernels compile for sm_90 (H100/H200) on this CPU-only machine, without spilling
registers to local memory: errors the interpreter cannot raise surface in CI."""

import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this triton has no bundled ptxas")
def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    script = os.path.join(os.path.dirname(__file__), "compile_sm90.py")
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if ": REG:" in line]
    assert len(lines) >= 9, done.stdout
    for line in lines:
        # No spills: no local memory. A stack frame of a few bytes without local traffic is a call
        # frame (triton 3.9's ptxas gives the sampler's filter variant 8 bytes; 3.6's gave none).
        stack = int(re.search(r"STACK:(\d+)", line).group(1))
        assert re.search(r"LOCAL:0\b", line) and stack <= 8, line
    # the MLA decode's 64-row candidates exist to run on wgmma (mma.sync otherwise)
    candidates = [line for line in lines if "_mla_decode_halves_kernel" in line]
    assert candidates and all(int(re.search(r"WGMMA:(\d+)", line).group(1)) > 0 for line in candidates), candidates
