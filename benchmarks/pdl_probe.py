"""What a small kernel costs inside a CUDA graph, and what programmatic dependent launch saves.

    PYTHONPATH=. python3 benchmarks/pdl_probe.py

A chain of N dependent small kernels (each reads the previous one's output: a 4096-wide row,
as a batch-1 RMSNorm would) is captured in one CUDA graph and replayed; the time per kernel
is what a fusion that removes one launch saves. The same chain is then launched with
programmatic dependent launch (each kernel waits for its predecessor with griddepcontrol.wait
before its first read; optionally the predecessor lets it launch early), to see whether
Hopper's early launch shortens the gaps.
"""

import statistics
import sys

import torch

import triton
import triton.language as tl


@triton.jit
def _step_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (x * 0.5 + 1.0).to(y_ptr.dtype.element_ty), mask=offs < n)


def chain_us(n_kernels: int, width: int, programs: int, wait: bool, trigger: bool, pdl: bool) -> float:
    bufs = [torch.randn(width * programs, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    block = width

    def run():
        for i in range(n_kernels):
            src, dst = bufs[i % 2], bufs[(i + 1) % 2]
            kwargs = {"launch_pdl": True} if pdl else {}
            _step_kernel[(programs,)](src, dst, src.numel(), BLOCK=block, WAIT=wait, TRIGGER=trigger,
                                      num_warps=4, **kwargs)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[5:]) / n_kernels


def check_pdl_order() -> bool:
    """With PDL and the wait, the chain still computes the same values as without."""
    x = torch.randn(4096 * 32, device="cuda", dtype=torch.float32)
    outs = []
    for pdl in (False, True):
        a, b = x.clone(), torch.empty_like(x)
        for i in range(200):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            kwargs = {"launch_pdl": True} if pdl else {}
            _step_kernel[(32,)](src, dst, src.numel(), BLOCK=4096, WAIT=pdl, TRIGGER=pdl, num_warps=4, **kwargs)
        torch.cuda.synchronize()
        outs.append(a.clone())
    return torch.equal(outs[0], outs[1])


def main() -> int:
    if not torch.cuda.is_available():
        print("pdl_probe.py needs a CUDA GPU", file=sys.stderr)
        return 1
    print("| chain of 200 kernels, programs x width | plain | PDL + wait | PDL + wait + early trigger |")
    print("|---|---|---|---|")
    for programs, width in ((1, 4096), (32, 1024), (256, 1024)):
        cells = [chain_us(200, width, programs, False, False, False)]
        for trigger in (False, True):
            try:
                cells.append(chain_us(200, width, programs, True, trigger, True))
            except Exception as e:  # noqa: BLE001 - report what this Triton/driver refuses
                print(f"PDL failed: {type(e).__name__}: {e}")
                cells.append(float("nan"))
        print(f"| {programs} x {width} | " + " | ".join(f"{c:.2f} us" for c in cells) + " |")
    try:
        print("PDL chain equals plain chain:", check_pdl_order())
    except Exception as e:  # noqa: BLE001
        print(f"PDL check failed: {type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
