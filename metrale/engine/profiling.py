"""The PyTorch profiler over chosen steps of a running engine (`met serve --profile DIR`, then
POST /start_profile and /stop_profile, vLLM's routes).

It is started and stopped on the engine thread, between steps, so a trace always holds whole
steps; with `num_steps` it stops by itself after that many. Each trace is a Chrome/Perfetto JSON
file in the directory (one per start/stop), also readable by TensorBoard's profiler plugin.
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._profile = None
        self._steps_left: int | None = None
        self._steps = 0
        self.last_trace: str | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, num_steps: int | None = None) -> None:
        if self.running:
            raise RuntimeError("the profiler is already running; POST /stop_profile first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.__enter__()
        self._steps_left, self._steps = num_steps, 0
        logger.info("profiler started%s; traces go to %s",
                    f" for {num_steps} steps" if num_steps else "", self.directory)

    def stop(self) -> str:
        """Stop and write the trace; returns its path."""
        if not self.running:
            raise RuntimeError("the profiler is not running; POST /start_profile first")
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        path = os.path.join(self.directory, f"met-trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-"
                                            f"{self._steps}steps.json")
        profile.export_chrome_trace(path)
        self.last_trace = path
        logger.info("profiler stopped after %d steps; trace: %s", self._steps, path)
        return path

    def after_step(self) -> None:
        """Called by the engine thread after each step."""
        if not self.running:
            return
        self._steps += 1
        if self._steps_left is not None and self._steps >= self._steps_left:
            self.stop()
