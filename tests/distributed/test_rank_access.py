"""Who may join a multi-rank engine and where its sockets listen (metrale/distributed/rank_access.py):
the refusals of a non-loopback --master-addr without the opt-in or without a secret, where the
secret comes from, and a real tp=2 engine on the CPU whose every TCP socket, in rank 0 and in its
worker, is on loopback, while strangers knock on its rendezvous port during startup without
changing a token."""

from __future__ import annotations

import datetime
import ipaddress
import os
import pickle
import socket
import threading

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.distributed.rank_access import (SECRET_ENV, RankAccessError, check_master_addr,
                                             keep_collectives_on_loopback, loopback_interface, rank_secret)
from metrale.distributed.rendezvous import AuthenticationError, RendezvousError, RendezvousStore
from parallel_cases import build_checkpoint, free_port, make_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_checkpoint("qwen3", str(tmp_path_factory.mktemp("ckpt_qwen3")))


def engine(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", device="cpu", **kwargs)


# -- the checks, without an engine ----------------------------------------------------------------

def test_a_remote_master_addr_needs_the_opt_in():
    for address in ("127.0.0.1", "127.3.0.1", "::1", "localhost"):
        check_master_addr(address, allow_remote_ranks=False)
    with pytest.raises(RankAccessError, match=r"^--master-addr 10\.0\.0\.1 is not a loopback address, .*pass "
                                              r"--allow-remote-ranks .*--rank-secret-file PATH.*MET_RANK_SECRET"):
        check_master_addr("10.0.0.1", allow_remote_ranks=False)
    for address in ("0.0.0.0", "node-0"):  # every interface, and a name, are remote too
        with pytest.raises(RankAccessError):
            check_master_addr(address, allow_remote_ranks=False)
    check_master_addr("10.0.0.1", allow_remote_ranks=True)


def test_the_secret_comes_from_the_file_or_the_environment(tmp_path):
    path = tmp_path / "secret"
    path.write_text("  0123456789abcdef0123\n")
    path.chmod(0o600)
    assert rank_secret(str(path), environ={}) == "0123456789abcdef0123"
    assert rank_secret(str(path), environ={SECRET_ENV: "from-the-environment-x"}) == "0123456789abcdef0123"
    env = {SECRET_ENV: "from-the-environment-x"}
    assert rank_secret(None, environ=env) == "from-the-environment-x" and SECRET_ENV in env
    assert rank_secret(None, environ=env, pop=True) == "from-the-environment-x" and SECRET_ENV not in env
    with pytest.raises(RankAccessError, match="shared secret, and none was given: pass --rank-secret-file PATH"):
        rank_secret(None, environ={})
    with pytest.raises(RankAccessError, match="has 5 characters; use at least 16"):
        rank_secret(None, environ={SECRET_ENV: "short"})
    with pytest.raises(RankAccessError, match="cannot read --rank-secret-file"):
        rank_secret(str(tmp_path / "missing"), environ={})


def test_a_secret_file_other_users_can_read_is_warned_about(tmp_path, caplog):
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123")
    path.chmod(0o644)
    assert rank_secret(str(path), environ={}) == "0123456789abcdef0123"
    assert "can be read by other users (mode 644); chmod 600 it" in caplog.text


def test_one_host_collectives_go_to_the_loopback_interface(caplog):
    assert loopback_interface() == "lo"  # Linux
    env = {}
    assert keep_collectives_on_loopback("cpu", env) == {"GLOO_SOCKET_IFNAME": "lo"} and env == {"GLOO_SOCKET_IFNAME": "lo"}
    env = {}
    assert keep_collectives_on_loopback("cuda", env) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    env = {"NCCL_SOCKET_IFNAME": "eth0"}  # the user's choice stands, with a warning
    assert keep_collectives_on_loopback("cuda", env) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and "NCCL_SOCKET_IFNAME=eth0 is set" in caplog.text


# -- refusals of an engine, before any rank starts ------------------------------------------------

def _assert_nothing_started():
    assert not torch.distributed.is_initialized()
    assert not _my_workers()


def _my_workers() -> list[int]:
    """This process's children that run the worker module."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"metrale.entrypoints.worker" in cmdline:
            found.append(int(name))
    return found


def test_an_engine_with_a_remote_master_addr_is_refused_without_the_flag(qwen3):
    with pytest.raises(RankAccessError, match=r"^--master-addr 10\.1\.2\.3 is not a loopback address"):
        engine(qwen3, tp_size=2, master_addr="10.1.2.3", master_port=free_port())
    _assert_nothing_started()


def test_an_engine_with_the_flag_but_no_secret_is_refused(qwen3, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(RankAccessError, match="authenticate to its rendezvous with a shared secret, and none was given"):
        engine(qwen3, tp_size=2, world_size=2, master_addr="10.1.2.3", master_port=free_port(),
               allow_remote_ranks=True)
    _assert_nothing_started()
    # With a secret, rank 0 gets as far as binding the address, which is not this host's.
    monkeypatch.setenv(SECRET_ENV, "0123456789abcdef0123456789abcdef")
    with pytest.raises(RankAccessError, match=r"cannot listen on 10\.1\.2\.3:\d+ .*must be an address of rank 0's host"):
        engine(qwen3, tp_size=2, world_size=2, master_addr="10.1.2.3", master_port=free_port(),
               allow_remote_ranks=True)
    _assert_nothing_started()


# -- a running tp=2 engine --------------------------------------------------------------------------

def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    return getattr(address, "ipv4_mapped", None) or address


def inet_sockets(pid: int) -> list[tuple[str, str, int, str]]:
    """(protocol, local address, local port, TCP state) of every inet socket `pid` holds: the
    socket inodes of its descriptors, looked up in its network namespace's tables."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    host, port = fields[1].split(":")
                    found.append((table, str(_address(host)), int(port, 16), fields[3]))
    return found


def _knock(port: int, stop: threading.Event, stats: dict) -> None:
    """Strangers at the rendezvous port until `stop`: garbage, a pickle, a wrong secret, silence."""
    silent = []
    payloads = [os.urandom(64), pickle.dumps({"rank": 1}), None, "wrong"]
    i = 0
    while not stop.is_set():
        payload = payloads[i % len(payloads)]
        i += 1
        try:
            if payload == "wrong":
                RendezvousStore("127.0.0.1", port, "a-secret-nobody-gave-me", datetime.timedelta(seconds=0.05))
            else:
                s = socket.create_connection(("127.0.0.1", port), timeout=1)
                if payload is None and len(silent) < 4:
                    silent.append(s)  # says nothing, holds the connection
                else:
                    s.sendall(payload or b"")
                    s.close()
            stats["connected"] += 1
        except AuthenticationError:
            stats["connected"] += 1
            stats["refused"] += 1
        except (OSError, RendezvousError):
            pass  # not listening (yet, or any more)
        stop.wait(0.005)
    for s in silent:
        s.close()


def test_a_tp2_engine_listens_on_loopback_only_and_strangers_change_nothing(qwen3):
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    expected = [o.outputs[0].token_ids for o in engine(qwen3).generate(prompts, GREEDY, use_tqdm=False)]
    port = free_port()
    stop, stats = threading.Event(), {"connected": 0, "refused": 0}
    knocker = threading.Thread(target=_knock, args=(port, stop, stats), daemon=True)
    knocker.start()
    try:
        llm = engine(qwen3, tp_size=2, master_port=port)
    finally:
        stop.set()
        knocker.join(10)
    try:
        parallel = llm.llm_engine.executor.parallel
        server = parallel.rendezvous.server
        assert server.address == ("127.0.0.1", port)
        assert stats["connected"] > 0 and stats["refused"] > 0 and server.refused > 0  # they did get in
        with socket.socket() as late:  # once every rank has joined, nobody else can connect
            assert late.connect_ex(("127.0.0.1", port)) != 0
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected

        worker = parallel.workers[0].process.pid
        for pid in (os.getpid(), worker):
            sockets = inet_sockets(pid)
            assert sockets, pid  # gloo's pairs at least
            assert all(ipaddress.ip_address(host).is_loopback for _, host, _, _ in sockets), (pid, sockets)
            listening = [s for s in sockets if s[0].startswith("tcp") and s[3] == "0A"]
            assert all(s[2] != port for s in listening), listening  # the rendezvous stopped listening
        with open(f"/proc/{worker}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{worker}/environ", "rb") as f:
            environ = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        secret = environ[SECRET_ENV.encode()]
        assert len(secret) == 64 and secret not in cmdline  # in the environment, not on the command line
        assert environ[b"GLOO_SOCKET_IFNAME"] == loopback_interface().encode()
    finally:
        llm.llm_engine.shutdown()
    assert not torch.distributed.is_initialized()

