"""The step messages rank 0 sends the worker ranks (1..W-1) of a multi-rank engine, and how a
worker follows them.

Rank 0 owns the scheduler. Each step it broadcasts the plan to every worker over a gloo group
on the CPU, then every rank runs the same plan on its shard; the layers' collectives meet inside
the forward pass. A message is a msgpack map sent as two broadcasts: its length (one int64),
then its bytes (uint8). Never pickle.

    {"type": "step", "step": N, "plan": SchedulerOutput.to_wire(), "read_first": bool,
     "sampled": [M, {request_id: token_id}]}
    {"type": "stop"}

Every rank samples (the logits are all-gathered, identical everywhere, and each request's draws
come from its own seeded stream), so a step costs no collective after the forward pass, and a
worker runs its steps exactly as rank 0 runs its own: launch step N, whose placeholder tokens
are taken from the device, then read step N-1's tokens. "read_first" says that rank 0 read the
step in flight before launching this one (synchronous scheduling, or a step that needs the real
tokens), and the worker does the same. Rank 0 is still the authority: "sampled" carries the
tokens of the last step M it read; a worker compares them with its own. A worker that drew other
tokens takes rank 0's when step M is the last it launched (synchronous scheduling); otherwise
its KV already holds its own, and it reports the divergence.

The worker process itself (its command line, startup and loop) is metrale/entrypoints/worker.py.
"""

from __future__ import annotations

import logging
import threading

import msgpack
import torch
import torch.distributed as dist

from metrale.messages.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class StepChannel:
    """Rank 0 -> all: msgpack messages broadcast over a CPU (gloo) group."""

    def __init__(self, group, src: int = 0):
        self.group, self.src = group, src
        self._lock = threading.Lock()  # one message at a time, whatever thread sends it

    def send(self, message: dict) -> None:
        payload = msgpack.packb(message, use_bin_type=True)
        with self._lock:
            dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), self.src, group=self.group)
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), self.src, group=self.group)

    def receive(self) -> dict:
        length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, self.src, group=self.group)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(payload, self.src, group=self.group)
        return msgpack.unpackb(payload.numpy().tobytes(), raw=False, strict_map_key=False)


def step_message(step: int, plan, read_first: bool, sampled: tuple[int, dict[str, int]]) -> dict:
    return {"type": "step", "step": step, "plan": plan.to_wire(), "read_first": read_first,
            "sampled": list(sampled)}


STOP_MESSAGE = {"type": "stop"}


class StepFollower:
    """A worker's side of the step protocol: launches rank 0's plans in rank 0's order, reads
    its own tokens, and checks them against rank 0's."""

    def __init__(self, runner):
        self.runner = runner
        self.inflight: tuple[int, object] | None = None  # (step, PendingOutput) not read yet
        self.last_launched = -1
        self.mine: dict[int, dict[str, int]] = {}  # this rank's tokens of read steps rank 0 has not confirmed
        self.diverged = 0

    def run(self, message: dict) -> None:
        if message.get("read_first", True):
            self._read_inflight()
        self._check(*message["sampled"])
        launched = self.runner.execute_async(SchedulerOutput.from_wire(message["plan"]))
        self._read_inflight()
        self.inflight, self.last_launched = (message["step"], launched), message["step"]

    def _read_inflight(self) -> None:
        if self.inflight is not None:
            step, pending = self.inflight
            self.mine[step] = dict(pending.result().sampled_token_ids)
            self.inflight = None

    def _check(self, step: int, theirs: dict[str, int]) -> None:
        mine = self.mine.pop(step, {})
        for older in [s for s in self.mine if s < step]:
            del self.mine[older]
        differ = {rid: token for rid, token in theirs.items() if rid in mine and mine[rid] != token}
        if not differ:
            return
        if step == self.last_launched and self.inflight is None:
            adopt_sampled(self.runner, differ)  # nothing built on them yet: follow rank 0
            message = "this rank sampled other tokens than rank 0 (nondeterministic logits?); following rank 0"
        else:
            message = (f"this rank sampled other tokens than rank 0 at step {step} under asynchronous "
                       f"scheduling ({len(differ)} request(s)); its KV holds its own")
        if not self.diverged:
            logger.warning(message)
        self.diverged += len(differ)


def adopt_sampled(runner, sampled: dict[str, int]) -> int:
    """Make this rank's last sampled tokens rank 0's; returns how many differed."""
    differed = 0
    for request_id, token in sampled.items():
        state = runner.requests.get(request_id)
        if state is not None and state.token_ids and state.token_ids[-1] != token:
            state.token_ids[-1] = token
            differed += 1
    return differed


def serve_steps(runner, channel: StepChannel) -> int:
    """Run rank 0's plans until the stop message; returns the number of steps."""
    follower, steps = StepFollower(runner), 0
    while True:
        message = channel.receive()
        if message["type"] == "stop":
            return steps
        if message["type"] != "step":
            raise RuntimeError(f"unknown message from rank 0: {message['type']!r}")
        follower.run(message)
        steps += 1
