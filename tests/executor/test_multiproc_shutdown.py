"""The order of a multi-rank engine's shutdown, which NCCL depends on: rank 0 tells the workers to
stop, frees its CUDA graphs (a live graph holding captured collectives makes NCCL's teardown hang,
pytorch/pytorch#115388), and only then tears the process groups down. Workers free theirs before
their own teardown too. Checked with stand-ins: the order is the property, not the GPU."""

from __future__ import annotations

from metrale.distributed import worker
from metrale.executor.multiproc_executor import _stop


class Recorder:
    def __init__(self):
        self.calls: list[str] = []


def test_rank_0_frees_graphs_after_the_stop_message_and_before_the_groups():
    log = Recorder()

    class Channel:
        def send(self, message):
            log.calls.append(f"send {message['type']}")

    class Parallel:
        closed = False

        def close(self):
            log.calls.append("close groups")

    class Runner:
        def release_cuda_graphs(self):
            log.calls.append("free graphs")

    _stop(Channel(), Parallel(), Runner())
    assert log.calls == ["send stop", "free graphs", "close groups"]


def test_a_worker_frees_graphs_before_its_groups(monkeypatch):
    log = Recorder()

    class Topology:
        rank = 1

    class Parallel:
        topology = Topology()
        control_group = None

        def close(self):
            log.calls.append("close groups")

    class Runner:
        def release_cuda_graphs(self):
            log.calls.append("free graphs")

    monkeypatch.setattr(worker, "build_worker", lambda args, spawned: (Parallel(), Runner()))
    monkeypatch.setattr(worker, "StepChannel", lambda group: None)
    monkeypatch.setattr(worker, "serve_steps", lambda runner, channel: log.calls.append("steps") or 3)
    assert worker.run_worker(args=None) == 0
    assert log.calls == ["steps", "free graphs", "close groups"]


def test_graphs_are_left_alone_when_the_workers_cannot_be_told():
    """After a peer died a collective may never end, and freeing graphs waits for the device."""
    log = Recorder()

    class Channel:
        def send(self, message):
            raise RuntimeError("connection closed by peer")

    class Parallel:
        closed = False

        def close(self):
            log.calls.append("close groups")

    class Runner:
        def release_cuda_graphs(self):
            log.calls.append("free graphs")

    _stop(Channel(), Parallel(), Runner())
    assert log.calls == ["close groups"]


def test_a_worker_that_lost_rank_0_does_not_wait_on_its_graphs(monkeypatch):
    log = Recorder()

    class Topology:
        rank = 1

    class Parallel:
        topology = Topology()
        control_group = None

        def close(self):
            log.calls.append("close groups")

    class Runner:
        def release_cuda_graphs(self):
            log.calls.append("free graphs")

    def lost(runner, channel):
        raise RuntimeError("connection reset")

    monkeypatch.setattr(worker, "build_worker", lambda args, spawned: (Parallel(), Runner()))
    monkeypatch.setattr(worker, "StepChannel", lambda group: None)
    monkeypatch.setattr(worker, "serve_steps", lost)
    assert worker.run_worker(args=None) == 1
    assert log.calls == ["close groups"]
