"""The rank rendezvous's wire (metrale/distributed/rendezvous.py): frames of a 4-byte big-endian
length and one msgpack map, never pickle, and the HMAC-SHA256 proofs of its handshake. Reading
a frame checks its length against a limit before reading its body, and a deadline bounds a whole
frame, however slowly the peer sends it."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time

import msgpack

PROTOCOL = "met-rendezvous/1"
NONCE_BYTES = 32
HANDSHAKE_FRAME_MAX = 512
MAX_FRAME = 64 << 20
_LENGTH = struct.Struct(">I")


def proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + b"|" + first + b"|" + second, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, size: int, deadline: float | None) -> bytes:
    """`size` bytes; with a deadline, all of them before it (a peer trickling bytes gains nothing)."""
    chunks, left = [], size
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the peer is too slow")
            sock.settimeout(remaining)
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send_frame(sock: socket.socket, message: dict) -> None:
    body = msgpack.packb(message, use_bin_type=True)
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_frame(sock: socket.socket, max_size: int, deadline: float | None = None) -> dict:
    (size,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size, deadline))
    if size > max_size:
        raise ValueError(f"a frame of {size} bytes (at most {max_size} here)")
    message = msgpack.unpackb(recv_exact(sock, size, deadline), raw=False, strict_map_key=True,
                              max_bin_len=max_size, max_str_len=max_size, max_array_len=1 << 16,
                              max_map_len=64, max_ext_len=0)
    if not isinstance(message, dict):
        raise ValueError("a frame that is not a map")
    return message


def field(message: dict, name: str, kind: type | tuple[type, ...]):
    value = message.get(name)
    if not isinstance(value, kind):
        raise ValueError(f"field {name!r} is missing or of the wrong type")
    return value


def shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
