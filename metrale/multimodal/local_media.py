"""Media a URL holds inline (data:) or names on this machine (file://), under the same caps as
fetched media.

- data: the payload's length is checked before it is decoded, so a 1 GB base64 string costs a
  length comparison, not a gigabyte;
- file://: only beneath the policy's allowed directory, after every symlink is resolved
  (realpath), so a link inside it that points out is refused; regular files only (a FIFO or a
  device would block or never end).
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from metrale.multimodal.errors import MediaError
from metrale.multimodal.fetch_policy import MediaFetchPolicy

# Besides "<modality>/*", the media types a data: URL of media may declare.
_NEUTRAL_TYPES = ("", "application/octet-stream")


def _a(modality: str) -> str:
    return f"an {modality}" if modality[0] in "aeiou" else f"a {modality}"


def read_data_url(url: str, modality: str, max_bytes: int) -> bytes:
    comma = url.find(",", 0, 1024)
    if comma < 0:
        raise MediaError("the data: URL has no ',' before its payload")
    params = [p.strip().lower() for p in url[len("data:"):comma].split(";")]
    media_type, is_base64 = params[0], params[-1] == "base64"
    if media_type not in _NEUTRAL_TYPES and not media_type.startswith(modality + "/"):
        raise MediaError(f"the data: URL declares type {media_type[:40]!r}, not {modality}/*")
    # Measured before the payload is copied or decoded (+ 2: a trailing newline some clients send).
    payload_chars = len(url) - comma - 1
    if payload_chars > (4 * ((max_bytes + 2) // 3) + 2 if is_base64 else 3 * max_bytes):
        raise MediaError(f"the data: URL holds more than the {max_bytes:,} bytes allowed for {_a(modality)}")
    payload = url[comma + 1:]
    if is_base64:
        try:
            data = base64.b64decode(payload.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the data: URL's payload is not valid base64") from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaError(f"the data: URL holds more than the {max_bytes:,} bytes allowed for {_a(modality)}")
    if not data:
        raise MediaError("the data: URL is empty")
    return data


def read_file_url(url: str, modality: str, policy: MediaFetchPolicy) -> bytes:
    root = policy.allowed_local_path
    if root is None:
        raise MediaError("file:// URLs are refused: the server runs without --allowed-local-media-path")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError("a file:// URL must name this machine (file:///path)")
    path = os.path.realpath(unquote(parts.path))
    if os.path.commonpath([path, root]) != root:
        raise MediaError("the file:// URL is outside --allowed-local-media-path (after resolving links)")
    max_bytes = policy.max_bytes(modality)
    try:
        # O_NOFOLLOW: the resolved path must not have become a link since; O_NONBLOCK: a FIFO
        # opens without waiting for a writer, and is refused below.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        raise MediaError("the file:// URL names no readable file") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise MediaError("the file:// URL does not name a regular file")
    with os.fdopen(fd, "rb") as f:
        if info.st_size > max_bytes:
            raise MediaError(f"the file is {info.st_size:,} bytes, more than the {max_bytes:,} allowed for {_a(modality)}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise MediaError(f"the file is more than the {max_bytes:,} bytes allowed for {_a(modality)}")
    return data
