"""The numbered, timed phases `met serve` logs while it starts."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


PHASE_FORMAT = "[%d] %-14s %7.2fs  %s"


def log_imports(seconds: float) -> None:
    """Phase 0, logged by the command itself: importing torch, transformers and the server."""
    logger.info(PHASE_FORMAT, 0, "imports", seconds, "torch and the HTTP server")


class StartupLog:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.number = 0
        self.start = time.perf_counter()

    def phase(self, name: str, detail: str = "") -> None:
        now = time.perf_counter()
        self.number += 1
        if self.enabled:
            logger.info(PHASE_FORMAT, self.number, name, now - self.start, detail)
        self.start = now
