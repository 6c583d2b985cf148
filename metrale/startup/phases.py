"""The numbered, timed phases `met serve` logs while it starts."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class StartupLog:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.number = 0
        self.start = time.perf_counter()

    def phase(self, name: str, detail: str = "") -> None:
        now = time.perf_counter()
        self.number += 1
        if self.enabled:
            logger.info("[%d] %-14s %7.2fs  %s", self.number, name, now - self.start, detail)
        self.start = now
