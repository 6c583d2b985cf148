"""A worker rank (1..W-1) of a multi-rank engine: its command line, startup and step loop.

Run as:
    python -m metrale.entrypoints.worker --rank R --engine-args JSON --spawned-by PID   (rank 0 spawns these)
    python -m metrale.entrypoints.worker serve|generate ... <met flags>                 (torchrun, or by hand)
In the second form rank 0 runs the `met` command itself and the other ranks serve steps. The
step protocol is metrale/distributed/step_channel.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from metrale.config.engine_args import EngineArgs
from metrale.distributed.launch import topology_from_args
from metrale.entrypoints.cli import build_parser
from metrale.entrypoints.cli import main as met_main
from metrale.startup.worker_rank import run_worker


def _configure_logging(rank: str) -> None:
    logging.basicConfig(level=logging.INFO, datefmt="%H:%M:%S",
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--engine-args" in argv:
        parser = argparse.ArgumentParser(prog="python -m metrale.entrypoints.worker")
        parser.add_argument("--engine-args", required=True, help="rank 0's EngineArgs as JSON")
        parser.add_argument("--rank", type=int, required=True)
        parser.add_argument("--spawned-by", type=int, default=None, help="rank 0's pid: exit when it is gone")
        ns = parser.parse_args(argv)
        args = EngineArgs(**dict(json.loads(ns.engine_args), rank=ns.rank))
        _configure_logging(str(ns.rank))
        return run_worker(args, ns.spawned_by)

    args = EngineArgs.from_cli_args(build_parser().parse_args(argv))
    topology, _ = topology_from_args(args)
    if topology.rank == 0:
        return met_main(argv)
    _configure_logging(str(topology.rank))
    return run_worker(args)


if __name__ == "__main__":
    sys.exit(main())
