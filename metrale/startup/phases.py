"""The numbered, timed phases of startup, logged as the reference system logs them.

The numbers and names are fixed, whatever the rank count and the device: a phase with nothing
to do on this run still logs its line (a single rank's "topology", a CPU run's "kernel audit"),
so two logs always line up. Worker ranks log theirs under their own rank (their log format
carries it). Phase 0 is the command's own (imports), "ready" the server's.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

PHASES = ("model resolve", "configure", "backend", "topology", "weights", "kv cache", "kernel audit", "ready")
PHASE_FORMAT = "[%d] %-14s %7.2fs  %s"


def log_imports(seconds: float) -> None:
    """Phase 0, logged by the command itself: importing torch and the server."""
    logger.info(PHASE_FORMAT, 0, "imports", seconds, "torch and the HTTP server")


class StartupLog:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = time.perf_counter()
        self.done: list[str] = []

    def phase(self, name: str, detail: str = "") -> None:
        """Phase `name` (one of PHASES) ended now; phases end in PHASES' order."""
        number = PHASES.index(name) + 1
        assert not self.done or PHASES.index(self.done[-1]) < number - 1, f"phase {name!r} out of order"
        now = time.perf_counter()
        if self.enabled:
            logger.info(PHASE_FORMAT, number, name, now - self.start, detail)
        self.done.append(name)
        self.start = now
