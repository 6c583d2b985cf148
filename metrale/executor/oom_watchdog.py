"""The OOM watchdog: a server that runs out of device memory should die loudly and be restarted,
not hang. Every `interval` seconds it reads the device's free memory; after `readings` low
readings in a row it logs the memory ledger and exits the process with status 1."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class OomWatchdog(threading.Thread):
    def __init__(self, read_free_bytes: Callable[[], int], threshold_mib: int, ledger: Callable[[], dict],
                 interval_s: float = 2.0, readings: int = 3, exit: Callable[[int], None] = os._exit):
        super().__init__(name="met-oom-watchdog", daemon=True)
        self.read_free_bytes = read_free_bytes
        self.threshold_bytes = threshold_mib << 20
        self.ledger = ledger
        self.interval_s = interval_s
        self.readings = readings
        self.exit = exit
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        low = 0
        while not self._stop.wait(self.interval_s):
            free = self.read_free_bytes()
            low = low + 1 if free < self.threshold_bytes else 0
            if low >= self.readings:
                logger.error("out of device memory: %d MiB free, below %d MiB for %d readings in a row; exiting so a "
                             "supervisor can restart the server. Memory ledger: %s", free >> 20,
                             self.threshold_bytes >> 20, low, json.dumps(self.ledger()))
                self.exit(1)
                return


def start_for(engine, threshold_mib: int) -> OomWatchdog | None:
    """On by default on GPU; `--oom-watchdog-mib 0` turns it off."""
    import torch

    from metrale.executor.memory_plan import memory_ledger

    if engine.device.type != "cuda" or threshold_mib <= 0:
        return None
    watchdog = OomWatchdog(lambda: torch.cuda.mem_get_info(engine.device)[0], threshold_mib,
                           lambda: memory_ledger(engine))
    watchdog.start()
    logger.info("OOM watchdog on: exits when free device memory stays under %d MiB for 3 readings 2 s apart",
                threshold_mib)
    return watchdog
