"""The order of a multi-rank engine's shutdown, which NCCL depends on: rank 0 tells the workers to
stop, frees its CUDA graphs (a live graph holding captured collectives makes NCCL's teardown hang,
pytorch/pytorch#115388), and only then tears the process groups down. Workers free theirs before
their own teardown too. Checked with stand-ins: the order is the property, not the GPU."""

from __future__ import annotations

import pytest

from metrale.startup import worker_rank as worker
from metrale.executor.multiproc_executor import _stop


class StandIns:
    """A runner, a parallel runtime and a step channel that log what is done to them."""

    def __init__(self, send_fails: bool = False):
        self.calls: list[str] = []
        log = self.calls

        class Topology:
            rank = 1

        class Parallel:
            closed = False
            topology = Topology()
            control_group = None

            def close(self):
                log.append("close groups")

        class Runner:
            def release_cuda_graphs(self):
                log.append("free graphs")

        class Channel:
            def send(self, message):
                if send_fails:
                    raise RuntimeError("connection closed by peer")
                log.append(f"send {message['type']}")

        self.parallel, self.runner, self.channel = Parallel(), Runner(), Channel()


def test_rank_0_frees_graphs_after_the_stop_message_and_before_the_groups():
    s = StandIns()
    _stop(s.channel, s.parallel, s.runner)
    assert s.calls == ["send stop", "free graphs", "close groups"]


def test_graphs_are_left_alone_when_the_workers_cannot_be_told():
    """After a peer died a collective may never end, and freeing graphs waits for the device."""
    s = StandIns(send_fails=True)
    _stop(s.channel, s.parallel, s.runner)
    assert s.calls == ["close groups"]


@pytest.fixture
def worker_with(monkeypatch):
    """run_worker over stand-ins, with `serve_steps` replaced by the given function."""
    def make(serve_steps) -> StandIns:
        s = StandIns()
        monkeypatch.setattr(worker, "build_worker", lambda args, spawned: (s.parallel, s.runner))
        monkeypatch.setattr(worker, "StepChannel", lambda group: None)
        monkeypatch.setattr(worker, "serve_steps", lambda runner, channel: serve_steps(s))
        return s

    return make


def test_a_worker_frees_graphs_before_its_groups(worker_with):
    s = worker_with(lambda s: s.calls.append("steps") or 3)
    assert worker.run_worker(args=None) == 0
    assert s.calls == ["steps", "free graphs", "close groups"]


def test_a_worker_that_lost_rank_0_does_not_wait_on_its_graphs(worker_with):
    def lost(s):
        raise RuntimeError("connection reset")

    s = worker_with(lost)
    assert worker.run_worker(args=None) == 1
    assert s.calls == ["close groups"]
