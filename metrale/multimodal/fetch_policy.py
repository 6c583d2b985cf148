"""MediaFetchPolicy: what the media fetcher may reach and how much it may take, from the flags.

Defaults are the safe ones: https only, any host whose every address is public, no file://,
20 MiB images, 256 MiB videos, 10 s per fetch, 64 Mpx per image or video frame.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

# (host, port) -> the addresses it resolves to, as text ("93.184.216.34", "2606:2800::1").
Resolver = Callable[[str, int], list[str]]

MAX_REDIRECTS = 5
# Connecting and each read wait at most this long, within the fetch's total timeout.
STEP_TIMEOUT_S = 5.0


def system_resolver(host: str, port: int) -> list[str]:
    """Every address getaddrinfo gives for the host (the fetcher checks them all)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def _domains(value) -> tuple[str, ...]:
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value or ())
    return tuple(dict.fromkeys(normalize_host(str(d)) for d in items if str(d).strip()))


def normalize_host(host: str) -> str:
    return host.strip().lower().rstrip(".")


@dataclass(frozen=True)
class MediaFetchPolicy:
    allowed_domains: tuple[str, ...] = ()  # empty: any host (its addresses still checked)
    allowed_local_path: str | None = None  # realpath'd; None: file:// refused
    allow_http: bool = False
    allow_private_addresses: bool = False  # UNSAFE outside tests on loopback
    max_image_bytes: int = 20 << 20
    max_video_bytes: int = 256 << 20
    total_timeout_s: float = 10.0
    connect_timeout_s: float = STEP_TIMEOUT_S
    read_timeout_s: float = STEP_TIMEOUT_S
    max_image_pixels: int = 64 << 20
    max_redirects: int = MAX_REDIRECTS
    resolver: Resolver = field(default=system_resolver, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_domains", _domains(self.allowed_domains))
        if self.allowed_local_path is not None:
            path = os.path.realpath(self.allowed_local_path)
            if not os.path.isdir(path):
                raise ValueError(f"allowed_local_media_path {self.allowed_local_path!r} is not a directory")
            object.__setattr__(self, "allowed_local_path", path)
        for name in ("max_image_bytes", "max_video_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("total_timeout_s", "connect_timeout_s", "read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.max_redirects <= MAX_REDIRECTS:
            raise ValueError(f"max_redirects must be in 0..{MAX_REDIRECTS}, got {self.max_redirects}")

    @classmethod
    def from_engine_args(cls, args) -> "MediaFetchPolicy":
        total = float(args.media_fetch_timeout)
        return cls(allowed_domains=_domains(args.allowed_media_domains),
                   allowed_local_path=args.allowed_local_media_path or None,
                   allow_http=bool(args.media_allow_http),
                   allow_private_addresses=bool(args.media_allow_private_addresses),
                   max_image_bytes=int(args.media_max_bytes), max_video_bytes=int(args.media_max_video_bytes),
                   total_timeout_s=total, connect_timeout_s=min(total, STEP_TIMEOUT_S),
                   read_timeout_s=min(total, STEP_TIMEOUT_S), max_image_pixels=int(args.media_max_image_pixels))

    def max_bytes(self, modality: str) -> int:
        return self.max_video_bytes if modality == "video" else self.max_image_bytes
