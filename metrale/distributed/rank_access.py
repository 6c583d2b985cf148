"""Who may join a multi-rank engine, and on which interface its sockets listen (docs/parallel.md,
"What listens where").

- A non-loopback `--master-addr` (ranks on several hosts) is refused unless the run opts in with
  `--allow-remote-ranks`: otherwise the rendezvous and the collectives' sockets stay on loopback.
- Every rank proves it holds the ranks' secret to the rendezvous (metrale/distributed/rendezvous.py).
  On one host rank 0 draws a fresh secret and hands it to the workers it spawns in their
  environment (never on a command line, which `ps` shows to every user). Ranks started apart
  from rank 0 (several hosts, by hand, torchrun without its agent's store) read it from
  `--rank-secret-file PATH` or MET_RANK_SECRET; a run without one is refused.
- On one host gloo's pair sockets (GLOO_SOCKET_IFNAME) and, on CUDA, NCCL's bootstrap sockets
  (NCCL_SOCKET_IFNAME) are put on the loopback interface, unless the user set those variables.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import stat
from dataclasses import dataclass

import torch.distributed as dist

from metrale.config.errors import StartupError
from metrale.distributed.rendezvous import RendezvousServer, RendezvousStore, new_secret

logger = logging.getLogger(__name__)

SECRET_ENV = "MET_RANK_SECRET"
MIN_SECRET_CHARS = 16
_IFF_LOOPBACK = 0x8
_SECRET_HINT = (f"pass --rank-secret-file PATH (a file only the ranks' user can read, the same on every host, "
                f"e.g. made with `openssl rand -hex 32 > PATH`) or set {SECRET_ENV}")


class RankAccessError(StartupError, ValueError):
    """The launch would let other hosts reach the ranks without the opt-in, or without a secret."""


def is_loopback(address: str) -> bool:
    """True for a loopback IP literal or "localhost" (a name is not resolved: a host name that
    happens to resolve to 127.x counts as remote, the stricter reading)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def check_master_addr(master_addr: str, allow_remote_ranks: bool) -> None:
    if not is_loopback(master_addr) and not allow_remote_ranks:
        raise RankAccessError(
            f"--master-addr {master_addr} is not a loopback address, so ranks on other hosts could reach this "
            f"engine's rendezvous; to run ranks on several hosts pass --allow-remote-ranks (LLM(..., "
            f"allow_remote_ranks=True)) and a shared secret ({_SECRET_HINT})")


def read_secret_file(path: str) -> str:
    try:
        info = os.stat(path)
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise RankAccessError(f"cannot read --rank-secret-file {path}: {e}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("--rank-secret-file %s can be read by other users (mode %o); chmod 600 it", path,
                       stat.S_IMODE(info.st_mode))
    return secret


def rank_secret(secret_file: str | None, environ=None, pop: bool = False) -> str:
    """The secret the ranks share, from the file if given, else from MET_RANK_SECRET (removed
    from `environ` when `pop`, so that this process's own children do not inherit it)."""
    env = os.environ if environ is None else environ
    from_env = env.pop(SECRET_ENV, None) if pop else env.get(SECRET_ENV)
    if secret_file:
        secret, where = read_secret_file(secret_file), f"--rank-secret-file {secret_file}"
    elif from_env is not None:
        secret, where = from_env.strip(), SECRET_ENV
    else:
        raise RankAccessError(f"ranks started apart from rank 0 authenticate to its rendezvous with a shared "
                              f"secret, and none was given: {_SECRET_HINT}")
    if len(secret) < MIN_SECRET_CHARS:
        raise RankAccessError(f"the rank secret from {where} has {len(secret)} characters; use at least "
                              f"{MIN_SECRET_CHARS} (e.g. `openssl rand -hex 32`)")
    return secret


def loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux), read from sysfs."""
    try:
        for name in sorted(os.listdir("/sys/class/net")):
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read().strip(), 16) & _IFF_LOOPBACK:
                    return name
    except (OSError, ValueError):
        pass
    return "lo"


def keep_collectives_on_loopback(device_type: str, environ=None) -> dict[str, str]:
    """On one host, put gloo's (and on CUDA NCCL's socket) traffic on the loopback interface,
    in this process's environment, which the workers it spawns inherit. A variable the user set
    is left alone. Returns what was set, for the log."""
    env = os.environ if environ is None else environ
    names = ["GLOO_SOCKET_IFNAME"] + (["NCCL_SOCKET_IFNAME"] if device_type == "cuda" else [])
    chosen = {}
    for name in names:
        if env.get(name):
            if env[name] != loopback_interface():
                logger.warning("%s=%s is set: that interface carries this one-host run's %s traffic", name,
                               env[name], name.split("_")[0].lower())
            continue
        chosen[name] = env[name] = loopback_interface()
    return chosen


# -- opening the rendezvous -----------------------------------------------------------------------

@dataclass
class Rendezvous:
    """This rank's handle on the rendezvous: the store every rank uses, and on rank 0 the server
    behind it (None under torchrun's agent store, and on the other ranks)."""
    store: dist.Store
    server: RendezvousServer | None
    port: int
    secret: str | None  # what rank 0 hands the workers it spawns

    def stop_accepting(self) -> None:
        """Every rank is connected and the groups exist: nobody new may connect."""
        if self.server is not None:
            self.server.stop_accepting()
            logger.info("rank rendezvous: every rank has joined; %s:%d no longer accepts connections",
                        *self.server.address)

    def close(self) -> None:
        if isinstance(self.store, RendezvousStore):
            self.store.close()
        if self.server is not None:
            self.server.close()


def _bind_host(master_addr: str) -> str:
    """The IP address rank 0 binds: master_addr itself, or what a name resolves to first."""
    try:
        ipaddress.ip_address(master_addr)
        return master_addr
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise RankAccessError(f"--master-addr {master_addr} does not resolve ({e})") from None


def _listen(host: str, port: int, secret: str, any_port: bool) -> RendezvousServer:
    try:
        return RendezvousServer(host, port, secret)
    except OSError as e:
        if not any_port:
            raise RankAccessError(f"cannot listen on {host}:{port} ({e}): --master-addr must be an address of rank "
                                  f"0's host and --master-port a free port") from None
    # On one host only our own workers need the port: a busy one is replaced by a free one.
    server = RendezvousServer(host, 0, secret)
    logger.info("port %d is in use; the rank rendezvous takes port %d instead", port, server.port)
    return server


def open_rendezvous(master_addr: str, master_port: int, world_size: int, rank: int, *, spawn: bool, spawned: bool,
                    agent_store: bool, secret_file: str | None, timeout: datetime.timedelta) -> Rendezvous:
    """Host (rank 0) or join the rendezvous. `spawn`: rank 0 of a one-host launch, which draws the
    secret; `spawned`: a worker it started; `agent_store`: torchrun's agent hosts a TCPStore."""
    if agent_store:
        if rank == 0:
            logger.warning("rank rendezvous: torchrun's own TCP store at %s:%d (TORCHELASTIC_USE_AGENT_STORE); "
                           "torchrun binds it, on every interface, and it does not authenticate: on a shared "
                           "network keep torchrun's port behind a firewall", master_addr, master_port)
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout,
                              wait_for_workers=False)
        return Rendezvous(store, None, master_port, None)
    secret = new_secret() if spawn else rank_secret(None if spawned else secret_file, pop=spawned)
    server = None
    host, port = master_addr, master_port
    if rank == 0:
        server = _listen(_bind_host(master_addr), master_port, secret, any_port=spawn)
        host, port = server.address
        logger.info("rank rendezvous listening on %s (read back from its socket), peers authenticated with "
                    "HMAC-SHA256 over a shared secret", _format(host, port))
        if ipaddress.ip_address(host).is_unspecified:
            logger.warning("rank rendezvous: %s is every interface of this host", host)
    try:
        store = RendezvousStore(host, port, secret, timeout)
    except BaseException:
        if server is not None:
            server.close()
        raise
    return Rendezvous(store, server, port, secret)


def _format(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
