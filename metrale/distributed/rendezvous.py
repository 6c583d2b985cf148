"""The rank rendezvous: a small key-value store that rank 0 hosts and every rank of a multi-rank
engine uses to form its process groups (gloo's and NCCL's address exchange goes through it).

It replaces torch's TCPStore, which listens on every interface whatever address it is given.
`RendezvousServer` listens on exactly one address (`master_addr:master_port`), and
`RendezvousStore` is a `torch.distributed.Store` whose every call is one request to it.

Invariants:

- The listening socket is bound to the one address given, never a wildcard unless that is the
  address given; `RendezvousServer.address` is read back from the socket, not from the argument.
- Every connection authenticates before the server reads a single request: the server sends a
  random nonce, the client answers with HMAC-SHA256(secret, "client" | server nonce | client
  nonce) and its own nonce, and the server proves itself back with HMAC-SHA256(secret, "server" |
  client nonce | server nonce). Proofs are compared with `hmac.compare_digest`. So neither side
  talks to a peer without the secret, and a recorded exchange cannot be replayed.
- A peer that sends a wrong proof, a frame that is not a small msgpack map, or nothing within
  HANDSHAKE_TIMEOUT_S is disconnected. It holds one thread for at most that long, at most
  MAX_PENDING_HANDSHAKES of them at once, and never touches the keys: the real ranks are served
  throughout.
- Frames are a 4-byte big-endian length, then one msgpack map (rendezvous_wire.py). Never
  pickle. Before the handshake a frame may be at most HANDSHAKE_FRAME_MAX bytes, after it
  MAX_FRAME bytes.
- One request is in flight per client connection (a lock); a blocking wait is sent as slices of
  at most WAIT_SLICE_S, so other threads of the same rank (NCCL's monitor) are served between.
- Semantics follow TCPStore's: `get` waits for the key, `add` keeps the counter as its decimal
  text, `compare_set` on a missing key sets it only when the expected value is empty.
"""

from __future__ import annotations

import datetime
import hmac
import logging
import secrets
import socket
import threading
import time

import msgpack
import torch.distributed as dist

from metrale.config.errors import StartupError
from metrale.distributed.rendezvous_wire import (HANDSHAKE_FRAME_MAX, MAX_FRAME, NONCE_BYTES, PROTOCOL, field,
                                                 proof, recv_frame, send_frame, shut)

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
MAX_PENDING_HANDSHAKES = 64
REFUSALS_LOGGED = 3  # as warnings; later ones at debug level, so that a flood cannot fill the log
WAIT_SLICE_S = 0.5
CONNECT_RETRY_S = 0.1


class RendezvousError(RuntimeError):
    """The rendezvous cannot be reached, refused this rank, or broke off."""


class UnreachableError(RendezvousError, StartupError):
    """No rendezvous answered at the address before the startup timeout."""


class AuthenticationError(RendezvousError, StartupError):
    """The peer does not hold the ranks' secret (or is not a met rendezvous)."""


def new_secret() -> str:
    """A fresh secret for the ranks of one launch (hex text: it travels in an environment variable)."""
    return secrets.token_hex(32)


# -- the server (rank 0) ------------------------------------------------------------------------

class RendezvousServer:
    """Listens on `host:port` (port 0: any free one) and serves the keys to authenticated ranks,
    one thread per connection, until `close()`."""

    def __init__(self, host: str, port: int, secret: str | bytes, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S):
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self._handshake_timeout_s = handshake_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # No dual-stack: "::1" must not also mean 127.0.0.1, nor "::" every IPv4 address.
        self._listener = socket.create_server((host, port), family=family, backlog=128, dualstack_ipv6=False)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._keys: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._accepting = True
        self._closed = False
        self.refused = 0  # connections dropped before or during the handshake (tests, logs)
        self._thread = threading.Thread(target=self._accept_loop, name="met-rendezvous", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.address[1]

    def stop_accepting(self) -> None:
        """Close the listening socket; the ranks already connected keep being served."""
        with self._lock:
            self._accepting = False
        self._close_listener()

    def close(self) -> None:
        with self._lock:
            self._accepting, self._closed = False, True
            connections = list(self._connections)
        self._close_listener()
        for conn in connections:
            shut(conn)
        with self._changed:
            self._changed.notify_all()

    def _close_listener(self) -> None:
        # shutdown() wakes the thread blocked in accept(); close() alone does not on Linux.
        shut(self._listener)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                with self._lock:
                    if not self._accepting:
                        return  # closed
                time.sleep(0.01)  # a connection aborted before it was accepted, or no descriptor left
                continue
            with self._lock:
                if not self._accepting:
                    conn.close()
                    return
            if not self._pending.acquire(blocking=False):
                self._count_refusal(peer, "too many connections are authenticating")
                conn.close()  # a flood of unauthenticated connections: drop the newest
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="met-rendezvous-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                self._pending.release()
                return
            self._connections.add(conn)
        try:
            try:
                authenticated = self._handshake(conn)
            finally:
                self._pending.release()
            if not authenticated:
                self._count_refusal(peer, "it did not prove it holds the ranks' secret")
                return
            conn.settimeout(None)  # ranks may stay idle for days
            while True:
                request = recv_frame(conn, MAX_FRAME)
                send_frame(conn, self._answer(request))
        except Exception:  # noqa: BLE001 - whatever a peer sends, only its own connection ends
            pass
        finally:
            with self._lock:
                self._connections.discard(conn)
            shut(conn)

    def _count_refusal(self, peer, reason: str) -> None:
        with self._lock:
            self.refused += 1
            count = self.refused
        level = logging.WARNING if count <= REFUSALS_LOGGED else logging.DEBUG
        logger.log(level, "rank rendezvous: dropped a connection from %s: %s (%d dropped so far)",
                   ":".join(map(str, peer[:2])), reason, count)

    def _handshake(self, conn: socket.socket) -> bool:
        conn.settimeout(self._handshake_timeout_s)
        deadline = time.monotonic() + self._handshake_timeout_s
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            send_frame(conn, {"protocol": PROTOCOL, "nonce": server_nonce})
            reply = recv_frame(conn, HANDSHAKE_FRAME_MAX, deadline)
            client_nonce, claimed = field(reply, "nonce", bytes), field(reply, "proof", bytes)
        except Exception:  # noqa: BLE001 - silence, garbage, a pickle, a frame too long: all alike
            return False
        if len(client_nonce) != NONCE_BYTES or not hmac.compare_digest(
                claimed, proof(self._secret, b"client", server_nonce, client_nonce)):
            try:
                send_frame(conn, {"error": "authentication failed"})
            except OSError:
                pass
            return False
        send_frame(conn, {"proof": proof(self._secret, b"server", client_nonce, server_nonce)})
        return True

    def _answer(self, request: dict) -> dict:
        """A malformed request from an authenticated rank is answered with an error, not a hang-up."""
        handler = _HANDLERS.get(request.get("op"))
        if handler is None:
            return {"error": f"unknown operation {str(request.get('op'))[:40]!r}"}
        try:
            with self._changed:
                return handler(self, request)
        except (ValueError, TypeError) as e:
            return {"error": f"{request['op']}: {e}"}

    # Each handler runs holding self._changed.
    def _op_set(self, r):
        self._keys[field(r, "key", str)] = field(r, "value", bytes)
        self._changed.notify_all()
        return {}

    def _op_get(self, r):
        key = field(r, "key", str)
        return {"value": self._keys[key]} if key in self._keys else {"missing": True}

    def _op_add(self, r):
        key, amount = field(r, "key", str), field(r, "amount", int)
        value = int(self._keys.get(key, b"0")) + amount
        self._keys[key] = str(value).encode()
        self._changed.notify_all()
        return {"value": value}

    def _op_compare_set(self, r):
        key, expected, desired = field(r, "key", str), field(r, "expected", bytes), field(r, "desired", bytes)
        current = self._keys.get(key)
        if current is None and expected:
            return {"value": expected}  # TCPStore's answer for a missing key
        if current is None or current == expected:
            self._keys[key] = desired
            self._changed.notify_all()
        return {"value": self._keys[key]}

    def _op_append(self, r):
        key = field(r, "key", str)
        self._keys[key] = self._keys.get(key, b"") + field(r, "value", bytes)
        self._changed.notify_all()
        return {}

    def _op_check(self, r):
        return {"value": all(k in self._keys for k in _keys_of(r))}

    def _op_wait(self, r):
        keys = _keys_of(r)
        slice_s = min(max(0.0, float(field(r, "timeout_s", (int, float)))), WAIT_SLICE_S)
        found = self._changed.wait_for(lambda: self._closed or all(k in self._keys for k in keys), slice_s)
        return {"value": bool(found) and not self._closed}

    def _op_delete_key(self, r):
        return {"value": self._keys.pop(field(r, "key", str), None) is not None}

    def _op_num_keys(self, r):
        return {"value": len(self._keys)}


def _keys_of(request: dict) -> list[str]:
    keys = field(request, "keys", list)
    if not all(isinstance(k, str) for k in keys):
        raise ValueError("keys must be strings")
    return keys


_HANDLERS = {name[len("_op_"):]: fn for name, fn in vars(RendezvousServer).items() if name.startswith("_op_")}


# -- the client (every rank, rank 0 included) -----------------------------------------------------

class RendezvousStore(dist.Store):
    """A `torch.distributed.Store` backed by a `RendezvousServer` at `host:port`. Connecting
    retries until `timeout` (the server may not be up yet); a wrong secret fails at once."""

    def __init__(self, host: str, port: int, secret: str | bytes,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=300)):
        super().__init__()
        self.host, self.port = host, port
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self._lock = threading.Lock()
        self.set_timeout(timeout)
        self._sock = self._connect(time.monotonic() + timeout.total_seconds())

    def _connect(self, deadline: float) -> socket.socket:
        """Retry until the deadline while the server is not up, or drops the connection before its
        greeting (it is busy with unauthenticated peers); a failed handshake fails at once."""
        while True:
            sock = None
            try:
                sock = socket.create_connection((self.host, self.port), timeout=HANDSHAKE_TIMEOUT_S)
                hello = recv_frame(sock, HANDSHAKE_FRAME_MAX, time.monotonic() + HANDSHAKE_TIMEOUT_S)
                break
            except (OSError, ConnectionError, ValueError, msgpack.UnpackException) as e:
                if sock is not None:
                    shut(sock)
                if time.monotonic() > deadline:
                    raise UnreachableError(f"cannot reach the rank rendezvous at {self.host}:{self.port}: {e}") from None
                time.sleep(CONNECT_RETRY_S)
        try:
            self._authenticate(sock, hello)
        except BaseException:
            shut(sock)
            raise
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _authenticate(self, sock: socket.socket, hello: dict) -> None:
        where = f"{self.host}:{self.port}"
        try:
            if hello.get("protocol") != PROTOCOL:
                raise AuthenticationError(f"{where} is not a met rank rendezvous (it greeted with {hello!r:.80})")
            server_nonce = field(hello, "nonce", bytes)
            client_nonce = secrets.token_bytes(NONCE_BYTES)
            send_frame(sock, {"nonce": client_nonce, "proof": proof(self._secret, b"client", server_nonce, client_nonce)})
            reply = recv_frame(sock, HANDSHAKE_FRAME_MAX, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        except (OSError, ConnectionError, ValueError, msgpack.UnpackException) as e:
            raise AuthenticationError(f"the handshake with the rank rendezvous at {where} failed ({e})") from None
        if "error" in reply:
            raise AuthenticationError(f"the rank rendezvous at {where} refused this rank's secret: every rank needs "
                                      f"the same one (--rank-secret-file or MET_RANK_SECRET)")
        claimed = reply.get("proof")
        if not isinstance(claimed, bytes) or not hmac.compare_digest(
                claimed, proof(self._secret, b"server", client_nonce, server_nonce)):
            raise AuthenticationError(f"the rank rendezvous at {where} could not prove it holds the ranks' secret")

    def _call(self, request: dict) -> dict:
        with self._lock:
            if self._sock is None:
                raise RendezvousError("the rank rendezvous client is closed")
            try:
                send_frame(self._sock, request)
                reply = recv_frame(self._sock, MAX_FRAME)
            except (OSError, ConnectionError, ValueError, msgpack.UnpackException) as e:
                raise RendezvousError(f"lost the rank rendezvous at {self.host}:{self.port} ({e})") from None
        if "error" in reply:
            raise RendezvousError(f"rank rendezvous: {reply['error']}")
        return reply

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                shut(self._sock)
                self._sock = None

    def _wait_for(self, keys: list[str], timeout: datetime.timedelta | None) -> None:
        """Until every key exists; a timeout of 0 waits for ever (TCPStore's reading)."""
        seconds = (self.timeout if timeout is None else timeout).total_seconds()
        deadline = time.monotonic() + seconds if seconds > 0 else None
        while True:
            left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                raise dist.DistStoreError(f"rank rendezvous: timed out after {seconds:.1f} s waiting for {keys}")
            if self._call({"op": "wait", "keys": keys, "timeout_s": left})["value"]:
                return

    # -- torch.distributed.Store ----------------------------------------------------------------

    def set(self, key: str, value) -> None:
        self._call({"op": "set", "key": key, "value": _as_bytes(value)})

    def get(self, key: str) -> bytes:
        reply = self._call({"op": "get", "key": key})
        if "missing" in reply:
            self._wait_for([key], None)
            reply = self._call({"op": "get", "key": key})
        return reply["value"]

    def add(self, key: str, amount: int) -> int:
        return self._call({"op": "add", "key": key, "amount": int(amount)})["value"]

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        return self._call({"op": "compare_set", "key": key, "expected": _as_bytes(expected_value),
                           "desired": _as_bytes(desired_value)})["value"]

    def append(self, key: str, value) -> None:
        self._call({"op": "append", "key": key, "value": _as_bytes(value)})

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def check(self, keys: list[str]) -> bool:
        return self._call({"op": "check", "keys": list(keys)})["value"]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait_for(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return self._call({"op": "delete_key", "key": key})["value"]

    def num_keys(self) -> int:
        return self._call({"op": "num_keys"})["value"]


def _as_bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
