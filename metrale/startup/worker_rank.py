"""A worker rank's life: build its groups and model runner in rank 0's order, then run rank 0's
step plans until the stop message (metrale/distributed/step_channel.py)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from metrale.distributed.step_channel import StepChannel, serve_steps
from metrale.startup.engine_parts import build_runner, prepare, report_ranks
from metrale.startup.phases import StartupLog

logger = logging.getLogger(__name__)


def _watch_parent(parent_pid: int) -> None:
    """A worker rank 0 spawned ends when rank 0 is gone, even if no collective notices. Ctrl-C in
    a terminal reaches the whole process group: rank 0 handles it and stops the workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="met-parent-watch", daemon=True).start()


def build_worker(args, spawned: bool):
    """This rank's groups and model runner, built in the same order as rank 0's (their
    collectives must meet): phases 1-4 (`prepare`), then `build_runner`. The phases are logged
    under this rank's name."""
    log = StartupLog(True)
    # The tokenizer only feeds startup work that must match rank 0's (fp8 KV calibration text).
    ready = prepare(args, log, spawned=spawned)
    parallel = ready.parallel
    if parallel is None:
        raise RuntimeError("a worker needs a world of more than one rank")
    try:
        runner, plan = build_runner(args, ready.config, ready.device, log, ready.tokenizer, parallel)
        report_ranks(ready, runner, plan)
    except BaseException:
        parallel.abort()
        raise
    return parallel, runner


def run_worker(args, spawned_by: int | None = None) -> int:
    if spawned_by is not None:
        _watch_parent(spawned_by)
    parallel, runner = build_worker(args, spawned=spawned_by is not None)
    rank = parallel.topology.rank
    try:
        steps = serve_steps(runner, StepChannel(parallel.control_group))
        runner.release_cuda_graphs()  # before the groups (see MultiprocExecutor); not after a failure
    except RuntimeError as e:
        logger.error("rank %d: lost rank 0 (%s)", rank, e)
        return 1
    finally:
        parallel.close()
    logger.info("rank %d: stopped after %d steps", rank, steps)
    return 0
