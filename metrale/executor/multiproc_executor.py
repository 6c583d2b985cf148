"""What the engine calls `execute(plan)` on: the local model runner alone, or, above one rank,
rank 0's runner after the plan has been broadcast to the worker ranks.

The engine keeps rank 0's ModelRunner as `engine.runner` (its model, KV cache and memory
numbers are this rank's); only `execute` and `shutdown` go through the executor.
"""

from __future__ import annotations

import logging
import weakref

from metrale.distributed.launch import ParallelRuntime, WorkerDiedError
from metrale.distributed.step_channel import STOP_MESSAGE, StepChannel, step_message
from metrale.messages.scheduler_output import ModelRunnerOutput, SchedulerOutput
from metrale.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class RankZeroStep:
    """Rank 0's launched step (a PendingOutput); reading its tokens records them, with the step's
    number, for the next message to the workers."""

    def __init__(self, executor: "MultiprocExecutor", step: int, pending):
        self.executor, self.step, self.pending = executor, step, pending
        self.read = False

    def result(self) -> ModelRunnerOutput:
        out = self.pending.result()
        if not self.read:
            self.read = True
            self.executor.last_read = (self.step, dict(out.sampled_token_ids))
        return out


class UniprocExecutor:
    supports_async = True  # a step can be launched before the previous one's tokens are read
    world_size = 1

    def __init__(self, runner: ModelRunner):
        self.runner = runner


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
    supports_async = True  # every rank launches step N+1 before reading step N (worker.StepFollower)

    def __init__(self, runner: ModelRunner, parallel: ParallelRuntime):
        self.runner, self.parallel = runner, parallel
        self.channel = StepChannel(parallel.control_group)
        self.last_read: tuple[int, dict[str, int]] = (-1, {})  # the last step whose tokens rank 0 read
        self._launched: RankZeroStep | None = None
        self._failed: BaseException | None = None
        # Not a method of self: the finalizer must not keep the executor alive.
        self._stopper = weakref.finalize(self, _stop, self.channel, parallel, runner)

    @property
    def world_size(self) -> int:
        return self.parallel.topology.world_size


    def execute_async(self, plan: SchedulerOutput) -> RankZeroStep:
        """Send the plan to the workers, then launch it here; the workers follow the same order
        of launches and reads as this rank."""
        if self._failed is not None:
            raise WorkerDiedError(f"the engine's worker ranks are gone: {self._failed}")
        if self.parallel.closed:
            raise WorkerDiedError("the multi-rank engine was shut down")
        previous = self._launched
        step = 0 if previous is None else previous.step + 1
        try:
            self.parallel.check_workers()
            self.channel.send(step_message(step, plan, previous is None or previous.read, self.last_read))
            self._launched = RankZeroStep(self, step, self.runner.execute_async(plan))
        except WorkerDiedError as e:
            self._failed = e
            raise
        except RuntimeError as e:
            # gloo reports a peer that went away as a RuntimeError ("Connection closed by peer").
            self._failed = self.parallel.failure(e)
            raise self._failed from e
        return self._launched

    def shutdown(self) -> None:
        """Stop the workers and drop the process groups; the engine cannot step afterwards."""
        self._stopper()

    def __getattr__(self, name: str):
        # The ModelRunner's attributes (backend, device, model, kv_bytes_per_block, requests, ...).
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)
