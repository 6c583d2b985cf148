"""Starting the ranks of a multi-rank engine and joining them into process groups.

Who starts whom (docs/parallel.md):

- one host: rank 0 (the process that serves HTTP, or calls `LLM(...)`) spawns ranks 1..W-1
  itself, as `python -m metrale.entrypoints.worker` subprocesses. This is the case when
  `--master-addr` is a loopback address and no torchrun environment is present;
- torchrun: every rank is started by torchrun, and RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
  and MASTER_PORT come from its environment (`torchrun ... -m metrale.entrypoints.worker serve ...`);
- several hosts: every rank is started by hand with --world-size, --rank, --master-addr (rank
  0's address, not a loopback one) and --master-port.

All ranks meet at the rank rendezvous on master_addr:master_port: rank 0 hosts it, bound to that
address only, and every rank proves it holds the ranks' secret (rendezvous.py, rank_access.py);
under torchrun, torchrun's agent may host a TCP store instead. Then they form: the world group
(NCCL on CUDA, gloo on CPU), every TP and EP group, and a gloo group on the CPU for the step
plans rank 0 broadcasts. The TP/EP/world groups go into `parallel_state`, and the MoE layout
(`init_moe_layout`) before any model is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from metrale.config.host import available_cores
from metrale.distributed import parallel_state
from metrale.distributed.moe_layout import init_moe_layout, moe_layout
from metrale.distributed.rank_access import (SECRET_ENV, Rendezvous, check_master_addr, is_loopback,
                                             keep_collectives_on_loopback, open_rendezvous)
from metrale.distributed.topology import Topology, TopologyError, resolve_topology
from metrale.messages.errors import EngineDeadError

# NVLink multicast stays off in NCCL, torch's symmetric memory and NVSHMEM: on shared hosts a
# program using it can take the GPUs out of service, and nothing here needs it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

logger = logging.getLogger(__name__)

# Workers wait for the next step plan for as long as the server idles.
CONTROL_TIMEOUT = datetime.timedelta(days=3650)
STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 15.0
GROUP_TEARDOWN_TIMEOUT_S = 30.0


class WorkerDiedError(EngineDeadError):
    """A rank of a multi-rank engine exited or stopped answering; the engine cannot continue."""


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the TCP store; rank 0 must not open its own


def torchrun_env(environ=None) -> TorchrunEnv | None:
    """The rank environment torchrun (or an equivalent launcher) set, if any."""
    env = os.environ if environ is None else environ
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(env.get(n) for n in names) or int(env["WORLD_SIZE"]) <= 1:
        return None
    return TorchrunEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])),
                       env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                       env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")


def topology_from_args(args, environ=None) -> tuple[Topology, TorchrunEnv | None]:
    """This process's topology: world size and rank from torchrun's environment when present,
    else from --world-size / --rank."""
    env = torchrun_env(environ)
    if env is None:
        return resolve_topology(args.tp_size, args.ep_size, args.world_size, args.rank), None
    if args.world_size > 1 and args.world_size != env.world_size:
        raise TopologyError(f"--world-size {args.world_size} disagrees with torchrun's WORLD_SIZE={env.world_size}")
    return resolve_topology(args.tp_size, args.ep_size, env.world_size, env.rank), env


# -- checks before anything is started ---------------------------------------------------------

@contextlib.contextmanager
def shard_sizes_of(topology: Topology, expert_layout: str):
    """Layers built inside take `topology`'s rank's shard sizes (no process group exists: build
    them on the meta device, to check a split or to plan a rank's memory)."""
    parallel_state.init_tensor_parallel(topology.tp_rank, topology.tp_size)
    parallel_state.init_expert_parallel(topology.ep_rank, topology.ep_size)
    parallel_state.init_world_group(topology.rank, topology.world_size)
    try:
        init_moe_layout(moe_layout(topology, expert_layout))
        yield
    finally:
        parallel_state.reset_parallel_state()
        init_moe_layout(None)


def ensure_no_live_groups(world_size: int) -> None:
    """One multi-rank engine per process: its groups are process-wide (layers read them when they
    are built, and torch.distributed has one default group)."""
    if not parallel_state.is_single_rank():
        gc.collect()  # an engine nobody refers to any more releases its groups when it is collected
    if not parallel_state.is_single_rank():
        raise RuntimeError("this process still holds the process groups of a multi-rank engine; shut that "
                           "engine down first (llm.llm_engine.shutdown())")
    if world_size > 1 and dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; a multi-rank engine "
                           "creates its own process groups")


# -- the running ranks ---------------------------------------------------------------------------

@dataclass
class WorkerProcess:
    rank: int
    process: subprocess.Popen

    def exit_code(self) -> int | None:
        return self.process.poll()


class ParallelRuntime:
    """What a rank holds once the groups exist: its topology and device, the CPU control group,
    and, on rank 0 of a one-host launch, the worker processes it started."""

    def __init__(self, topology: Topology, device: torch.device, control_group, rendezvous: Rendezvous,
                 workers: list[WorkerProcess]):
        self.topology, self.device, self.control_group = topology, device, control_group
        self.rendezvous, self.workers = rendezvous, workers
        self.closed = False

    def agree_min(self, value: int) -> int:
        """The smallest `value` over all ranks (every rank calls it at the same point)."""
        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        except RuntimeError as e:
            raise self.failure(e) from None
        return int(t.item())

    def check_workers(self) -> None:
        for worker in self.workers:
            code = worker.exit_code()
            if code is not None:
                raise WorkerDiedError(f"worker rank {worker.rank} (pid {worker.process.pid}) exited with code "
                                      f"{code}; the engine cannot continue without it (see the worker's log above)")

    def failure(self, error: BaseException) -> Exception:
        """The error to raise when a collective with the other ranks failed."""
        deadline = time.monotonic() + 2.0  # a peer that closed its sockets is usually exiting
        while self.workers and time.monotonic() < deadline:
            try:
                self.check_workers()
            except WorkerDiedError as e:
                return e
            time.sleep(0.05)
        return WorkerDiedError(f"a collective with the other ranks failed ({error}); a peer rank has probably "
                               f"died or restarted: see its log")

    def close(self) -> None:
        """Wait for the workers (rank 0 has sent them the stop message), then drop every group."""
        if self.closed:
            return
        self.closed = True
        # NCCL's teardown may meet the peers' (the workers tear down on the stop message), so
        # rank 0 tears down alongside them; gloo's is local and waits until they have read it.
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        if nccl:
            self._drop_groups()
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for worker in self.workers:
            try:
                worker.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("worker rank %d did not stop; killing it", worker.rank)
                worker.process.kill()
                worker.process.wait()
        if not nccl:
            self._drop_groups()

    def abort(self) -> None:
        """Startup failed on this rank: stop the workers it started, drop the groups."""
        if self.closed:
            return
        self.closed = True
        kill_workers(self.workers)
        self._drop_groups()

    def _drop_groups(self) -> None:
        if dist.is_initialized():
            _destroy_groups_within(GROUP_TEARDOWN_TIMEOUT_S)
        parallel_state.reset_parallel_state()
        init_moe_layout(None)
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None


def _destroy_groups_within(seconds: float) -> None:
    """destroy_process_group, bounded: NCCL's teardown can wait on peers (and hangs while a CUDA
    graph holds captured collectives, which is why runners release theirs first). Past the bound
    this process keeps its groups, says so, and cannot start another multi-rank engine."""
    done = threading.Event()

    def destroy():
        if dist.get_backend() == "nccl":
            torch.cuda.synchronize()  # inside the bound too: a collective whose peer died never ends
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, name="met-destroy-groups", daemon=True).start()
    if not done.wait(seconds):
        logger.error("the process groups did not shut down within %.0f s; leaving them (this process cannot "
                     "start another multi-rank engine)", seconds)


def kill_workers(workers: list[WorkerProcess]) -> None:
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.kill()
    for worker in workers:
        worker.process.wait()


def rank_device(requested: torch.device, local_rank: int) -> torch.device:
    if requested.type != "cuda":
        return requested
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise TopologyError(f"local rank {local_rank} needs GPU {local_rank}, but this host has {count}")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def spawn_workers(args, topology: Topology, device: torch.device, master_port: int,
                  secret: str) -> list[WorkerProcess]:
    """Ranks 1..W-1 of a one-host launch, as fresh interpreters (never a fork of a process that may
    hold CUDA). They get rank 0's EngineArgs as JSON, with the resolved world size and port, and
    the rendezvous secret in their environment (a command line is visible to every user)."""
    wire = dict(dataclasses.asdict(args), world_size=topology.world_size, master_port=master_port)
    env = dict(os.environ, **MULTICAST_OFF, **{SECRET_ENV: secret})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in env:
        # Every rank computes at once; more threads than cores in all only adds contention.
        env["OMP_NUM_THREADS"] = str(max(1, available_cores() // topology.world_size))
    workers = []
    for rank in range(1, topology.world_size):
        command = [sys.executable, "-m", "metrale.entrypoints.worker", "--spawned-by", str(os.getpid()),
                   "--rank", str(rank), "--engine-args", json.dumps(dict(wire, rank=rank))]
        workers.append(WorkerProcess(rank, subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)))
    logger.info("started %d worker rank(s): pids %s", len(workers), ", ".join(str(w.process.pid) for w in workers))
    return workers


def _wait_for_workers(store, workers: list[WorkerProcess]) -> None:
    keys = [f"joined/{w.rank}" for w in workers]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check(keys):
        for worker in workers:
            code = worker.exit_code()
            if code is not None:
                raise WorkerDiedError(f"worker rank {worker.rank} exited with code {code} during startup "
                                      f"(see its log above)")
        if time.monotonic() > deadline:
            raise WorkerDiedError(f"worker ranks did not join within {STARTUP_TIMEOUT_S:.0f}s")
        time.sleep(0.02)


def _group_of(rank: int, world_size: int, all_ranks: list[list[int]]):
    """Create every group of a partition (all ranks call this alike); return this rank's group
    and its rank in it. A group of the whole world is the default group."""
    mine = None
    for ranks in all_ranks:
        group = dist.group.WORLD if len(ranks) == world_size else dist.new_group(ranks)
        if rank in ranks:
            mine = (group, ranks.index(rank))
    return mine


def _init_groups(topology: Topology, device: torch.device, oneshot_max_kb: int) -> None:
    tp_group, tp_rank = _group_of(topology.rank, topology.world_size, topology.tp_group_ranks())
    ep_group, ep_rank = _group_of(topology.rank, topology.world_size, topology.ep_group_ranks())
    oneshots: dict[int, object] = {}

    def oneshot(group, size):
        if size == 1:
            return None
        if id(group) not in oneshots:
            oneshots[id(group)] = parallel_state.make_oneshot_all_reduce(group, oneshot_max_kb, device)
        return oneshots[id(group)]

    parallel_state.init_tensor_parallel(tp_rank, topology.tp_size, tp_group, oneshot(tp_group, topology.tp_size))
    parallel_state.init_expert_parallel(ep_rank, topology.ep_size, ep_group, oneshot(ep_group, topology.ep_size))
    world = dist.group.WORLD
    parallel_state.init_world_group(topology.rank, topology.world_size, world, oneshot(world, topology.world_size))


def join_ranks(args, topology: Topology, env: TorchrunEnv | None, device: torch.device,
               spawned: bool = False) -> ParallelRuntime:
    """Join (or, on rank 0 of a one-host launch, start) the other ranks of a world above one rank
    and set the groups layers use. The model split has been checked (startup.parallel)."""
    os.environ.update(MULTICAST_OFF)
    addr, port = (env.master_addr, env.master_port) if env else (args.master_addr, args.master_port)
    check_master_addr(addr, args.allow_remote_ranks)
    spawn = env is None and not spawned and topology.rank == 0 and is_loopback(addr)
    local_rank = env.local_rank if env else topology.rank if (spawn or spawned) else (
        topology.rank % max(1, torch.cuda.device_count()) if device.type == "cuda" else 0)
    if spawn and device.type == "cuda" and torch.cuda.device_count() < topology.world_size:
        raise TopologyError(f"{topology.world_size} ranks on one host need {topology.world_size} GPUs; "
                            f"this host has {torch.cuda.device_count()}")
    device = rank_device(device, local_rank)
    if is_loopback(addr):
        chosen = keep_collectives_on_loopback(device.type)
        if chosen and topology.rank == 0:
            logger.info("collectives on loopback: %s", ", ".join(f"{k}={v}" for k, v in chosen.items()))
    rendezvous = open_rendezvous(addr, port, topology.world_size, topology.rank, spawn=spawn, spawned=spawned,
                                 agent_store=env is not None and env.agent_store, secret_file=args.rank_secret_file,
                                 timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    store = rendezvous.store
    workers = spawn_workers(args, topology, device, rendezvous.port, rendezvous.secret) if spawn else []
    try:
        if workers:
            _wait_for_workers(store, workers)
        else:
            store.set(f"joined/{topology.rank}", b"1")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("metrale", store), rank=topology.rank,
                                world_size=topology.world_size, device_id=device if device.type == "cuda" else None)
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        _init_groups(topology, device, getattr(args, "all_reduce_oneshot_max_kb", 0))
        init_moe_layout(moe_layout(topology, args.moe_expert_layout))
        rendezvous.stop_accepting()
    except BaseException:
        kill_workers(workers)
        if dist.is_initialized():
            _destroy_groups_within(GROUP_TEARDOWN_TIMEOUT_S)
        parallel_state.reset_parallel_state()
        init_moe_layout(None)
        rendezvous.close()
        raise
    logger.info("parallel: %s, %s backend, device %s", topology.describe(), backend, device)
    return ParallelRuntime(topology, device, control, rendezvous, workers)
