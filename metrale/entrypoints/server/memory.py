"""GET /memory: per device, how much memory there is and what the server holds.

weights: bytes of the model's parameters and buffers. kv_cache: the paged caches (blocks x bytes
per block, every layer's K/V under one block table). state_cache: models with per-request state
(linear attention): the slots x bytes per slot, running slots in use beside their total.
activation_reserve: what the engine's memory plan set aside for activations (measured on CUDA,
estimated on CPU; `activation_reserve_measured` says which). `caches` names each kind of cache,
its layers and bytes (the cache layout). For the CPU, total and free are the host's MemTotal and
MemAvailable.
"""

from __future__ import annotations

import torch

from metrale.config.host import resident_bytes
from metrale.engine.async_engine import AsyncEngine


def _host_memory() -> tuple[int | None, int | None]:
    fields = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None, None
    return fields.get("MemTotal"), fields.get("MemAvailable")


def _device_memory(device: torch.device) -> tuple[int | None, int | None]:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    return _host_memory()


class MemoryReport:
    """Static sizes are measured once, when the model is ready; block use comes from the snapshot."""

    def __init__(self, engine: AsyncEngine):
        llm = engine.engine
        self.engine = engine
        self.device = llm.device
        model = llm.runner.model
        self.weights_bytes = sum(t.numel() * t.element_size()
                                 for t in list(model.parameters()) + list(model.buffers()))
        layout = llm.runner.layout
        self.kv_bytes_per_block = layout.bytes_per_block
        self.state_bytes_per_slot = layout.bytes_per_slot
        self.caches = layout.summary()
        self.state_cache_bytes = llm.runner.caches.state_bytes if llm.runner.caches is not None else 0
        self.block_size = llm.args.block_size
        plan = getattr(llm, "memory_plan", None)
        self.activation_bytes = getattr(plan, "activation_reserve_bytes", 0)
        self.activation_measured = bool(getattr(plan, "activation_measured", False))
        self.forward = llm.runner.forward_mode
        # Above one rank: each rank's device and host memory as of the end of startup.
        self.ranks = list(getattr(plan, "ranks", []))
        self.host_baseline = getattr(plan, "host_baseline_bytes", None)

    def host(self) -> dict:
        """This process's resident host memory, and its footprint over the baseline taken at startup
        before any backend existed."""
        rss = resident_bytes()
        footprint = rss - self.host_baseline if rss is not None and self.host_baseline is not None else None
        return {"baseline_rss_bytes": self.host_baseline, "rss_bytes": rss, "footprint_bytes": footprint}

    def as_dict(self) -> dict:
        from metrale.executor.memory_plan import memory_ledger

        snapshot = self.engine.snapshot
        total, free = _device_memory(self.device)
        kv_bytes = snapshot.kv_blocks_total * self.kv_bytes_per_block
        return {"forward": self.forward, "host": self.host(), "ranks": self.ranks, "devices": [{
            "device": str(self.device),
            "total_bytes": total,
            "free_bytes": free,
            "weights_bytes": self.weights_bytes,
            "kv_cache_bytes": kv_bytes,
            "activation_reserve_bytes": self.activation_bytes,
            "activation_reserve_measured": self.activation_measured,
            "kv_blocks_total": snapshot.kv_blocks_total,
            "kv_blocks_in_use": snapshot.kv_blocks_total - snapshot.kv_blocks_free,
            "kv_block_size_tokens": self.block_size,
            "kv_bytes_per_block": self.kv_bytes_per_block,
            "state_cache_bytes": self.state_cache_bytes,
            "state_bytes_per_slot": self.state_bytes_per_slot,
            "state_slots_total": snapshot.state_slots_total,
            "state_slots_in_use": snapshot.state_slots_total - snapshot.state_slots_free,
            "caches": self.caches,
            "ledger": memory_ledger(self.engine.engine),
        }]}
