"""The hardware floors the benchmarks print, on the configs of real models (meta device)."""

import torch

from metrale.bench.hardware import HardwareRates, decode_floor, offline_floor
from metrale.bench.workload import random_workload, step_weight_bytes, weights_read_per_step
from metrale.config.model_config import load_model_config
from metrale.startup.model_source import resolve_model_dir
from metrale.models.registry import get_model_class, supported_architectures

RATES = HardwareRates("test", 4e12, 800e12)


def meta_model(name):
    config = load_model_config(resolve_model_dir(name, "dummy"), "bfloat16", torch.device("cuda"), 4096,
                               supported_architectures())
    with torch.device("meta"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            return get_model_class(config.architecture)(config)
        finally:
            torch.set_default_dtype(torch.float32)


def test_dense_step_reads_every_weight_but_the_input_embedding():
    model = meta_model("Qwen3-8B")
    total = sum(p.numel() * 2 for p in model.parameters())
    embedding = 151936 * 4096 * 2
    assert weights_read_per_step(model, 1)[0] == total - embedding
    assert weights_read_per_step(model, 256)[0] == total - embedding
    assert weights_read_per_step(model, 1)[1] == (total - embedding) // 2


def test_moe_step_reads_only_reachable_experts():
    model = meta_model("Qwen3-30B-A3B")
    experts = 48 * 128 * 3 * 2048 * 768 * 2
    one, active = weights_read_per_step(model, 1)
    many, _ = weights_read_per_step(model, 256)
    assert many - one == experts - experts * 8 // 128
    assert active * 2 == one  # per token: top-8 experts and every dense weight
    assert step_weight_bytes(model)(1) == one


def test_offline_floor_counts_kv_reads_and_running_requests():
    work = random_workload(4, (10, 20), (3, 6), seed=0)
    floor = offline_floor(lambda tokens: 1000, 10, 2, work.input_lens, work.output_lens, RATES)
    kv = sum(o * i + o * (o - 1) // 2 for i, o in zip(work.input_lens, work.output_lens))
    assert floor.bytes_moved == 1000 * (max(work.output_lens) + 1) + 2 * kv
    assert floor.flops == 2 * 10 * (sum(work.input_lens) + sum(work.output_lens))
    assert floor.bound == "memory"


def test_decode_floor_per_step():
    floor = decode_floor(100, 50, 4, [[10, 20], [11, 21]], RATES)
    assert floor.bytes_moved == 2 * 100 + 4 * (30 + 32)
    assert floor.flops == 2 * 50 * 4
