"""What the engine calls `execute(plan)` on: the local model runner alone, or, above one rank,
rank 0's runner after the plan has been broadcast to the worker ranks.

The engine keeps rank 0's ModelRunner as `engine.runner` (its model, KV cache and memory
numbers are this rank's); only `execute` and `shutdown` go through the executor.
"""

from __future__ import annotations

import logging
import weakref

from metrale.distributed.launch import ParallelRuntime, WorkerDiedError
from metrale.distributed.worker import STOP_MESSAGE, StepChannel, step_message
from metrale.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from metrale.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class FinishedStep:
    """A step that already ran, with the interface of a launched one (PendingOutput)."""

    def __init__(self, result: ModelRunnerOutput):
        self._result = result

    def result(self) -> ModelRunnerOutput:
        return self._result


class UniprocExecutor:
    supports_async = True  # a step can be launched before the previous one's tokens are read
    world_size = 1

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(plan)

    def execute_async(self, plan: SchedulerOutput):
        """Launch a step; the returned PendingOutput's result() reads its sampled tokens."""
        return self.runner.execute_async(plan)

    def shutdown(self) -> None:
        pass


def _stop(channel: StepChannel, parallel: ParallelRuntime, runner: ModelRunner) -> None:
    """Send the stop message (if the workers can still hear it), free the CUDA graphs, and wait
    for the workers. Runs once: from shutdown(), when the executor is collected, or at exit."""
    try:
        if not parallel.closed:
            channel.send(STOP_MESSAGE)
            # Only when the workers heard it: after a peer died, a collective may never end, and
            # freeing the graphs waits for the device (close() bounds its own wait).
            runner.release_cuda_graphs()
    except Exception as e:  # noqa: BLE001 - a dead peer cannot be told; close() reaps it anyway
        logger.warning("could not send the stop message to the worker ranks: %s", e)
    parallel.close()


class MultiprocExecutor:
    # Worker ranks follow the tokens rank 0 drew in the previous step: steps run one at a time.
    supports_async = False

    def __init__(self, runner: ModelRunner, parallel: ParallelRuntime):
        self.runner, self.parallel = runner, parallel
        self.channel = StepChannel(parallel.control_group)
        self._last_sampled: dict[str, int] = {}
        self._failed: BaseException | None = None
        # Not a method of self: the finalizer must not keep the executor alive.
        self._stopper = weakref.finalize(self, _stop, self.channel, parallel, runner)

    @property
    def world_size(self) -> int:
        return self.parallel.topology.world_size

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        if self._failed is not None:
            raise WorkerDiedError(f"the engine's worker ranks are gone: {self._failed}")
        if self.parallel.closed:
            raise WorkerDiedError("the multi-rank engine was shut down")
        try:
            self.parallel.check_workers()
            self.channel.send(step_message(plan, self._last_sampled))
            out = self.runner.execute(plan)
        except WorkerDiedError as e:
            self._failed = e
            raise
        except RuntimeError as e:
            # gloo reports a peer that went away as a RuntimeError ("Connection closed by peer").
            self._failed = self.parallel.failure(e)
            raise self._failed from e
        self._last_sampled = dict(out.sampled_token_ids)
        return out

    def execute_async(self, plan: SchedulerOutput) -> FinishedStep:
        return FinishedStep(self.execute(plan))

    def shutdown(self) -> None:
        """Stop the workers and drop the process groups; the engine cannot step afterwards."""
        self._stopper()

    def __getattr__(self, name: str):
        # The ModelRunner's attributes (backend, device, model, kv_bytes_per_block, requests, ...).
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)
