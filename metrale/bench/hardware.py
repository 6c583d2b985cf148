"""What the hardware can do, measured at the start of a run, and the floor of a workload on it.

The floor of a run is the time the bytes it must move take at the measured copy bandwidth
(weights read once per step, plus every sequence's KV read once per step), or the time its
FLOPs take at the measured matmul rate, whichever is larger. achieved / floor says how close
the engine came to what the hardware allows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class HardwareRates:
    device: str
    bandwidth_bytes_per_s: float  # device-to-device copy, read + write bytes
    matmul_flops_per_s: float  # bf16 dense matmul

    def describe(self) -> str:
        return (f"{self.device}: copy bandwidth {self.bandwidth_bytes_per_s / 1e12:.2f} TB/s, "
                f"bf16 matmul {self.matmul_flops_per_s / 1e12:.0f} TFLOP/s (measured now)")


def _time_cuda(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def measure(device: torch.device) -> HardwareRates:
    if device.type != "cuda":
        return _measure_cpu()
    name = torch.cuda.get_device_name(device)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    seconds = _time_cuda(lambda: dst.copy_(src), 10)
    bandwidth = 2 * src.numel() / seconds
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    seconds = _time_cuda(lambda: a @ b, 10)
    return HardwareRates(name, bandwidth, 2 * n ** 3 / seconds)


def _measure_cpu() -> HardwareRates:
    src = torch.empty(1 << 27, dtype=torch.uint8)
    dst = torch.empty_like(src)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    bandwidth = 2 * src.numel() * 5 / (time.perf_counter() - start)
    a = torch.randn(1024, 1024)
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    return HardwareRates("cpu", bandwidth, 2 * 1024 ** 3 * 5 / (time.perf_counter() - start))


@dataclass
class Floor:
    bytes_moved: float
    flops: float
    rates: HardwareRates

    @property
    def seconds(self) -> float:
        return max(self.bytes_moved / self.rates.bandwidth_bytes_per_s, self.flops / self.rates.matmul_flops_per_s)

    @property
    def bound(self) -> str:
        memory = self.bytes_moved / self.rates.bandwidth_bytes_per_s
        return "memory" if memory >= self.flops / self.rates.matmul_flops_per_s else "compute"


def decode_floor(weight_bytes: int, active_params: int, kv_bytes_per_token: int,
                 contexts_per_step: list[list[int]], rates: HardwareRates, state_bytes_per_seq: int = 0) -> Floor:
    """Decode steps: each reads the weights once and each sequence's context once, and reads
    and writes each sequence's per-request state (linear-attention layers) once."""
    moved = flops = 0.0
    for contexts in contexts_per_step:
        moved += weight_bytes + kv_bytes_per_token * sum(contexts) + 2 * state_bytes_per_seq * len(contexts)
        flops += 2 * active_params * len(contexts)
    return Floor(moved, flops, rates)


def prefill_floor(weight_bytes: int, active_params: int, prompt_lengths: list[int], rates: HardwareRates,
                  state_bytes_per_seq: int = 0) -> Floor:
    """The weights once, each prompt's state written once."""
    tokens = sum(prompt_lengths)
    return Floor(weight_bytes + state_bytes_per_seq * len(prompt_lengths), 2 * active_params * tokens, rates)


def offline_floor(step_bytes, active_params: int, kv_bytes_per_token: int, input_lens: list[int],
                  output_lens: list[int], rates: HardwareRates, state_bytes_per_seq: int = 0) -> Floor:
    """All requests at once. Decode step t runs every request with more than t outputs to go and
    reads the weights those tokens need (`step_bytes(tokens)`) plus each one's context, and reads
    and writes its state; the prefill reads the weights once and writes each state once; every
    token is computed once at `active_params` per token."""
    kv_reads = sum(o * i + o * (o - 1) // 2 for i, o in zip(input_lens, output_lens))
    running = sorted(output_lens)
    moved, alive = float(step_bytes(sum(input_lens))), len(running)
    for step in range(max(output_lens)):
        while running and running[0] <= step:
            running.pop(0)
            alive -= 1
        moved += step_bytes(alive)
    moved += kv_bytes_per_token * kv_reads
    moved += state_bytes_per_seq * (len(input_lens) + 2 * sum(max(0, o - 1) for o in output_lens))
    flops = 2 * active_params * (sum(input_lens) + sum(output_lens))
    return Floor(moved, flops, rates)
