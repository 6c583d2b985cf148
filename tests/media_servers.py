"""Loopback HTTP(S) servers that serve media and misbehave on purpose, a transport that lands
"public" addresses on them, and small media made in memory. Nothing leaves 127.0.0.1."""

from __future__ import annotations

import io
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
from PIL import Image

# Stand-ins for public hosts: the fake resolver answers these, PinnedToLoopback lands them on a server.
PUBLIC_IP = "93.184.216.34"
PUBLIC_IP_2 = "93.184.216.35"


def png_bytes(width: int = 7, height: int = 5, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), (10, 200, 30) if mode == "RGB" else None).save(buffer, "PNG")
    return buffer.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (its pixel data is a few bytes)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _chunk(b"IEND", b""))


def png_zlib_bomb(side: int = 12000) -> bytes:
    """A real, valid 1-bit grayscale PNG of side x side zeros: ~20 KB that decodes to side**2 pixels."""
    row = b"\0" + b"\0" * ((side + 7) // 8)
    data = zlib.compress(row * side, 9)
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


def mp4_bytes(frames: int = 20, fps: int = 10, width: int = 32, height: int = 24) -> bytes:
    """A short MPEG-4 Part 2 video whose frame i is gray level 10 * i."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 10 * i, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "MediaServer"

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.hits.append((self.path, self.headers.get("Host")))
        path, _, query = self.path.partition("?")
        try:
            if path == "/png":
                self._send(200, png_bytes(), {"Content-Type": "image/png"})
            elif path == "/redirect":
                self._send(302, headers={"Location": query})
            elif path.startswith("/loop/"):
                self._send(302, headers={"Location": f"/loop/{int(path[6:]) + 1}"})
            elif path == "/huge":  # claims 5 GB and sends zeros until the client goes
                self._stream(headers={"Content-Length": str(5 << 30)})
            elif path == "/endless":  # no length: sends until the client goes
                self._stream(headers={"Connection": "close"})
            elif path == "/drip":  # a byte a second, forever
                self._stream(headers={"Connection": "close"}, chunk=b"\0", pause_s=1.0)
            elif path == "/gzip":
                self._send(200, zlib.compress(png_bytes()), {"Content-Encoding": "gzip"})
            elif path == "/missing":
                self._send(404, b"no")
            else:
                self._send(200, self.server.files.get(path, b""))
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _stream(self, headers: dict, chunk: bytes = b"\0" * 65536, pause_s: float = 0.0) -> None:
        self.send_response(200)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        deadline = time.monotonic() + 30  # never outlives a test by much
        while time.monotonic() < deadline and not self.server.stopping:
            self.wfile.write(chunk)
            self.wfile.flush()
            self.server.bytes_sent += len(chunk)
            if pause_s:
                time.sleep(pause_s)


class MediaServer(ThreadingHTTPServer):
    """`with MediaServer() as server:` serves on 127.0.0.1:server.port (plain http); `files`
    maps extra paths to bodies; `hits` records (path, Host header) of every request."""

    daemon_threads = True

    def __init__(self, ssl_context=None):
        super().__init__(("127.0.0.1", 0), _Handler)
        if ssl_context is not None:
            self.socket = ssl_context.wrap_socket(self.socket, server_side=True)
        self.port = self.server_address[1]
        self.hits: list[tuple[str, str]] = []
        self.files: dict[str, bytes] = {}
        self.bytes_sent = 0
        self.stopping = False

    def __enter__(self) -> "MediaServer":
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping = True
        self.shutdown()
        self.server_close()


class PinnedToLoopback(httpx.AsyncHTTPTransport):
    """The test's network: a request to PUBLIC_IP[_2] lands on a loopback server's port, and every
    request is recorded as (address connected to, port, Host header, SNI) before it is sent."""

    def __init__(self, ports: dict[str, int], seen: list, **kwargs):
        super().__init__(retries=0, **kwargs)
        self.ports, self.seen = ports, seen

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.seen.append((host, request.url.port, request.headers.get("host"),
                          request.extensions.get("sni_hostname")))
        if host not in self.ports:
            raise httpx.ConnectError("the test network reaches only its own addresses")
        # The connection goes to loopback; the TLS name stays the request's SNI.
        request.url = request.url.copy_with(host="127.0.0.1", port=self.ports[host])
        return await super().handle_async_request(request)


def fake_resolver(table: dict[str, list[str]]):
    calls = []

    def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        return list(table.get(host, []))

    resolve.calls = calls
    return resolve
