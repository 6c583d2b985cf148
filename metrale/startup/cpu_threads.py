"""How many threads torch's CPU kernels use: chosen from the cores this process may use, never
more, and logged.

A server keeps one core for its own threads (the HTTP event loop and the tokenizer lanes):
OpenMP threads spin while they wait, and one more of them than there are cores turns a 10 ms
decode step into 100 ms on a busy 2-core machine. OMP_NUM_THREADS, when set, is the user's
choice and wins.
"""

from __future__ import annotations

import logging
import os

import torch

from metrale.config.host import available_cores

logger = logging.getLogger(__name__)


def choose_cpu_threads(cores: int, reserved_cores: int, ranks: int = 1, environ=None) -> tuple[int, str]:
    """(threads, why) for a process that may use `cores`, keeps `reserved_cores` for its other
    threads and shares the rest with `ranks` - 1 other ranks of the same engine on this host."""
    env = os.environ if environ is None else environ
    requested = env.get("OMP_NUM_THREADS", "").strip()
    if requested:
        try:
            return max(1, int(requested)), "OMP_NUM_THREADS"
        except ValueError:
            logger.warning("OMP_NUM_THREADS=%r is not a number; ignoring it", requested)
    threads = max(1, (cores - reserved_cores) // ranks)
    why = f"{cores} core(s) available"
    if reserved_cores and cores > 1:
        why += f", {min(reserved_cores, cores - 1)} kept for the server's own threads"
    if ranks > 1:
        why += f", shared by {ranks} ranks"
    return threads, why


def set_cpu_threads(reserved_cores: int, ranks: int = 1) -> int:
    threads, why = choose_cpu_threads(available_cores(), reserved_cores, ranks)
    torch.set_num_threads(threads)
    logger.info("CPU threads: %d (%s)", threads, why)
    return threads
