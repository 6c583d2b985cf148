"""The rank rendezvous (metrale/distributed/rendezvous.py), without an engine: the store's
semantics, its timeouts, the mutual handshake, and strangers (no secret, garbage, a pickle,
silence, a flood) that are dropped while the real ranks keep being served. Each test takes well
under a few seconds: timeouts are shortened where a test waits for one."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import struct
import threading
import time

import msgpack
import pytest
import torch.distributed as dist

from metrale.distributed import rendezvous, rendezvous_wire
from metrale.distributed.rendezvous import (AuthenticationError, RendezvousError, RendezvousServer, RendezvousStore,
                                            new_secret)

SECRET = new_secret()
SHORT = datetime.timedelta(seconds=5)


@pytest.fixture
def server():
    srv = RendezvousServer("127.0.0.1", 0, SECRET, handshake_timeout_s=0.5)
    yield srv
    srv.close()


def client(srv: RendezvousServer, secret: str = SECRET, timeout=SHORT) -> RendezvousStore:
    return RendezvousStore(*srv.address, secret, timeout)


def wait_until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_binds_the_address_it_is_given_and_reports_it():
    srv = RendezvousServer("127.0.0.1", 0, SECRET)
    try:
        host, port = srv.address
        assert host == "127.0.0.1" and port > 0 and srv.port == port
        with socket.socket() as probe:  # another local address on the same port finds nobody
            probe.settimeout(1)
            assert probe.connect_ex(("127.0.0.2", port)) != 0
    finally:
        srv.close()


def test_set_get_add_compare_set_check_delete(server):
    a, b = client(server), client(server)
    a.set("k", b"v1")
    assert b.get("k") == b"v1"
    a.set("s", "text")  # torch passes str or bytes
    assert b.get("s") == b"text"
    assert a.add("n", 3) == 3 and b.add("n", -1) == 2 and a.get("n") == b"2"
    assert a.compare_set("k", b"v1", b"v2") == b"v2"
    assert a.compare_set("k", b"wrong", b"v3") == b"v2"  # no swap: the current value
    assert a.compare_set("fresh", b"", b"x") == b"x"  # a missing key is set when nothing was expected
    assert a.compare_set("absent", b"y", b"z") == b"y" and not a.check(["absent"])  # TCPStore's answer
    a.append("log", b"ab")
    a.append("log", b"cd")
    assert b.get("log") == b"abcd"
    assert a.multi_get(["k", "log"]) == [b"v2", b"abcd"]
    assert b.check(["k", "n"]) and not b.check(["k", "nope"])
    assert a.num_keys() == 5  # k, s, n, fresh, log
    assert a.delete_key("k") and not a.delete_key("k")
    assert not b.check(["k"])
    a.close()
    with pytest.raises(RendezvousError, match="closed"):
        a.get("n")


def test_get_and_wait_block_until_another_rank_sets_the_key(server):
    a, b = client(server), client(server)
    threading.Timer(0.3, lambda: a.set("late", b"here")).start()
    started = time.monotonic()
    assert b.get("late") == b"here"
    assert 0.2 < time.monotonic() - started < 3
    threading.Timer(0.2, lambda: a.set("w2", b"1")).start()
    b.wait(["late", "w2"])  # no timeout given: the store's


def test_wait_and_get_time_out(server):
    store = client(server, timeout=datetime.timedelta(seconds=0.7))
    assert store.timeout == datetime.timedelta(seconds=0.7)
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timed out"):
        store.get("never")
    assert 0.6 < time.monotonic() - started < 3
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], datetime.timedelta(seconds=0.2))
    store.set_timeout(datetime.timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"])
    store.set("after", b"ok")  # the connection is still good after a timeout
    assert store.get("after") == b"ok"


def test_no_server_yet_is_retried_until_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=f"cannot reach the rank rendezvous at 127.0.0.1:{port}"):
        RendezvousStore("127.0.0.1", port, SECRET, datetime.timedelta(seconds=0.5))
    assert time.monotonic() - started < 3
    # A server that comes up while the rank retries is joined.
    late = {}
    threading.Timer(0.3, lambda: late.update(srv=RendezvousServer("127.0.0.1", port, SECRET))).start()
    try:
        store = RendezvousStore("127.0.0.1", port, SECRET, datetime.timedelta(seconds=5))
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        late["srv"].close()


def test_a_wrong_secret_is_refused_and_the_ranks_carry_on(server):
    real = client(server)
    real.set("k", b"v")
    with pytest.raises(AuthenticationError, match="refused this rank's secret"):
        client(server, secret="not-the-secret-at-all")
    wait_until(lambda: server.refused == 1)  # counted by the server thread after it answered
    assert real.get("k") == b"v"
    assert client(server).get("k") == b"v"


def test_a_rank_refuses_a_server_without_the_secret():
    impostor = RendezvousServer("127.0.0.1", 0, "an-impostors-secret-0123456789")
    try:
        with pytest.raises(AuthenticationError):
            client(impostor)
    finally:
        impostor.close()


def _fake_server(reply: dict):
    """A listener that greets like a rendezvous, then answers the client's proof with `reply`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn:
            rendezvous_wire.send_frame(conn, {"protocol": rendezvous_wire.PROTOCOL, "nonce": os.urandom(32)})
            rendezvous_wire.recv_frame(conn, 4096)
            rendezvous_wire.send_frame(conn, reply)
            conn.recv(1)

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_the_server_must_prove_the_secret_too():
    """A squatter on the port that accepts any proof cannot fake the server's answer."""
    listener = _fake_server({"proof": b"\0" * 32})
    try:
        with pytest.raises(AuthenticationError, match="could not prove it holds the ranks' secret"):
            RendezvousStore(*listener.getsockname(), SECRET, SHORT)
    finally:
        listener.close()


class _Boom:
    """Unpickling this would create a file: the proof that nothing unpickles."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _stranger(port: int, payload: bytes | None, read_hello: bool = True) -> bool:
    """Connect, send `payload` (None: nothing), and report whether the server hung up on us."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        if read_hello:
            s.recv(4096)
        if payload:
            try:
                s.sendall(payload)
            except OSError:
                return True
        try:
            while s.recv(4096):
                pass
        except OSError:
            pass
        return True


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize("name", ["garbage", "pickle", "pickle_in_a_frame", "huge_length", "not_a_map",
                                  "wrong_fields", "silence", "silence_before_hello", "trickle"])
def test_strangers_are_dropped_and_the_ranks_keep_being_served(server, tmp_path, name):
    real = client(server)
    real.set("before", b"1")
    waiting = {}
    waiter = threading.Thread(target=lambda: waiting.update(value=client(server).get("during")))
    waiter.start()  # a rank blocked in a wait while the stranger is around
    marker = tmp_path / "unpickled"
    payloads = {
        "garbage": os.urandom(300),
        "pickle": pickle.dumps(_Boom(str(marker))),
        "pickle_in_a_frame": _frame(pickle.dumps(_Boom(str(marker)))),
        "huge_length": struct.pack(">I", 2**31) + b"x" * 100,
        "not_a_map": _frame(msgpack.packb([1, 2, 3])),
        "wrong_fields": _frame(msgpack.packb({"nonce": "str", "proof": 5})),
        "silence": None,
        "silence_before_hello": None,
        "trickle": None,
    }
    started = time.monotonic()
    if name == "trickle":  # a byte at a time, each within the socket timeout: the handshake's deadline ends it
        with socket.create_connection(server.address, timeout=5) as s:
            s.recv(4096)
            s.setblocking(False)
            closed = False
            while not closed and time.monotonic() - started < 3:
                try:
                    s.sendall(b"\x00")
                    closed = s.recv(1) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    closed = True
                time.sleep(0.05)
            assert closed
    else:
        assert _stranger(server.port, payloads[name], read_hello=name != "silence_before_hello")
    assert time.monotonic() - started < 3  # silence is cut off by the handshake timeout (0.5 s here)
    wait_until(lambda: server.refused == 1)
    assert not marker.exists()
    real.set("during", b"2")
    waiter.join(5)
    assert waiting == {"value": b"2"}
    assert real.get("before") == b"1" and client(server).get("during") == b"2"


def test_an_authenticated_rank_gets_errors_for_bad_requests_not_a_hang_up(server):
    store = client(server)
    with store._lock:
        rendezvous_wire.send_frame(store._sock, {"op": "explode"})
        assert "unknown operation" in rendezvous_wire.recv_frame(store._sock, 4096)["error"]
        rendezvous_wire.send_frame(store._sock, {"op": "set", "key": 5, "value": b"x"})
        assert "error" in rendezvous_wire.recv_frame(store._sock, 4096)
    store.set("n", b"not a number")
    with pytest.raises(RendezvousError, match="add"):
        store.add("n", 1)
    assert store.get("n") == b"not a number"


def test_a_flood_of_silent_strangers_delays_a_rank_but_does_not_stop_it(monkeypatch):
    monkeypatch.setattr(rendezvous, "MAX_PENDING_HANDSHAKES", 4)
    srv = RendezvousServer("127.0.0.1", 0, SECRET, handshake_timeout_s=0.5)
    flood = [socket.create_connection(srv.address) for _ in range(8)]
    try:
        wait_until(lambda: srv.refused >= 4)  # the connections past the cap were dropped at once
        store = client(srv)  # retried until the silent ones timed out
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        for s in flood:
            s.close()
        srv.close()


def test_stop_accepting_keeps_the_connected_ranks(server):
    store = client(server)
    server.stop_accepting()
    with socket.socket() as probe:
        assert probe.connect_ex(server.address) != 0
    store.set("k", b"v")
    assert store.get("k") == b"v"
    server.close()
    with pytest.raises(RendezvousError, match="lost the rank rendezvous"):
        store.get("k")


def test_gloo_forms_groups_through_the_store():
    """torch calls a Python store from C++: init_process_group and new_group of a one-rank world."""
    srv = RendezvousServer("127.0.0.1", 0, SECRET)
    store = client(srv)
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("t", store), rank=0, world_size=1)
        group = dist.new_group(backend="gloo")
        import torch

        t = torch.ones(2)
        dist.all_reduce(t, group=group)
        assert t.tolist() == [1.0, 1.0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        store.close()
        srv.close()
