"""The media fetcher against servers on loopback (reliability cases 15 and 16).

Only the allowed case opts in to loopback (--media-allow-private-addresses, --media-allow-http).
The other cases run with the default address rules: a fake resolver answers the test's host
names and PinnedToLoopback lands the two stand-in public addresses on a loopback server, so
redirects and hops can be followed without leaving the machine. Those servers speak plain http,
so those cases allow http and nothing else; the https case (SNI and the certificate checked
against the URL's name while connecting to the pinned address) runs over TLS with a certificate
the test makes.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import time

import pytest

from media_servers import PUBLIC_IP, PUBLIC_IP_2, MediaServer, PinnedToLoopback, fake_resolver, png_bytes
from metrale.multimodal import fetch
from metrale.multimodal.errors import MediaError
from metrale.multimodal.fetch import fetch_media, fetch_media_sync
from metrale.multimodal.fetch_policy import MediaFetchPolicy
from metrale.multimodal.image_decode import decode_image

RESOLVES = {"media.example": [PUBLIC_IP], "cdn.example": [PUBLIC_IP_2], "inner.example": ["10.0.0.1"],
            "mapped.example": ["::ffff:127.0.0.1"], "ula.example": ["fd00::1"],
            "mixed.example": [PUBLIC_IP, "10.1.2.3"], "meta.example": ["169.254.169.254"]}


@pytest.fixture
def server():
    with MediaServer() as s:
        yield s


@pytest.fixture
def network(server, monkeypatch):
    """The two public stand-ins reach `server`; `seen` records every request the fetcher sends."""
    seen = []
    monkeypatch.setattr(fetch, "make_transport",
                        lambda policy: PinnedToLoopback({PUBLIC_IP: server.port, PUBLIC_IP_2: server.port}, seen))
    return seen


def policy(**kwargs) -> MediaFetchPolicy:
    kwargs.setdefault("resolver", fake_resolver(RESOLVES))
    return MediaFetchPolicy(**kwargs)


def refused(url: str, pol: MediaFetchPolicy, modality: str = "image") -> str:
    with pytest.raises(MediaError) as info:
        asyncio.run(fetch_media(url, pol, modality))
    message = str(info.value)
    assert "0x" not in message
    for address in ("10.0.0.1", "10.1.2.3", "fd00::1", "127.0.0.1", "169.254.169.254", PUBLIC_IP, PUBLIC_IP_2):
        assert address not in message or address in url, message  # never a resolved address
    return message


def test_allowed_loopback_png_is_fetched_and_decoded(server):
    unsafe = MediaFetchPolicy(allow_http=True, allow_private_addresses=True)
    data = fetch_media_sync(f"http://127.0.0.1:{server.port}/png", unsafe)
    image = decode_image(data, unsafe.max_image_pixels)
    assert image.size == (7, 5) and image.mode == "RGB" and image.getpixel((0, 0)) == (10, 200, 30)


def test_loopback_is_refused_without_connecting(server):
    message = refused(f"https://127.0.0.1:{server.port}/png", policy())
    assert "loopback" in message
    assert "loopback" in refused(f"http://127.0.0.1:{server.port}/png", policy(allow_http=True))
    assert "link-local" in refused("https://169.254.169.254/latest/meta-data/", policy())
    assert "loopback" in refused(f"https://[::1]:{server.port}/png", policy())
    assert server.hits == []


def test_plain_http_is_refused_by_default(server):
    assert "plain http" in refused(f"http://media.example/png", policy())


@pytest.mark.parametrize("host,reason", [("inner.example", "private"), ("mapped.example", "loopback"),
                                         ("ula.example", "private"), ("mixed.example", "private"),
                                         ("meta.example", "link-local")])
def test_names_resolving_inward_are_refused(network, host, reason):
    message = refused(f"https://{host}/png", policy())
    assert f"host {host} resolves to a {reason} address" in message
    assert network == []  # nothing was sent anywhere


def test_unresolvable_and_other_schemes(network):
    assert "does not resolve" in refused("https://nowhere.example/png", policy())
    assert "scheme 'ftp'" in refused("ftp://media.example/png", policy())
    assert "credentials" in refused("https://user:pw@media.example/png", policy())
    assert network == []


def test_pinned_to_the_checked_address(network, server):
    """The request goes to the address that was checked, with the URL's host as Host; the name
    is resolved exactly once."""
    resolver = fake_resolver(RESOLVES)
    data = asyncio.run(fetch_media("http://media.example/png", policy(allow_http=True, resolver=resolver)))
    assert data == png_bytes()
    assert network == [(PUBLIC_IP, None, "media.example", None)]
    assert resolver.calls == ["media.example"]
    assert server.hits == [("/png", "media.example")]


@pytest.mark.parametrize("target,reason", [("http://127.0.0.1:{port}/png", "loopback"),
                                           ("http://169.254.169.254/latest/meta-data/", "link-local"),
                                           ("http://inner.example/png", "private"),
                                           ("http://[::ffff:127.0.0.1]:{port}/png", "loopback")])
def test_redirect_inward_is_refused(network, server, target, reason):
    url = f"http://media.example/redirect?{target.format(port=server.port)}"
    assert reason in refused(url, policy(allow_http=True))
    assert [h[0].partition("?")[0] for h in server.hits] == ["/redirect"]  # its target was never asked
    assert len(network) == 1


def test_redirect_is_checked_against_the_allowed_domains(network, server):
    pol = policy(allow_http=True, allowed_domains=("media.example",))
    assert "not in --allowed-media-domains" in refused("http://media.example/redirect?http://cdn.example/png", pol)
    assert len(network) == 1
    both = policy(allow_http=True, allowed_domains="media.example, cdn.example")
    assert asyncio.run(fetch_media("http://media.example/redirect?http://cdn.example/png", both)) == png_bytes()
    assert [n[0] for n in network[1:]] == [PUBLIC_IP, PUBLIC_IP_2]  # each hop to its own checked address
    assert "not in --allowed-media-domains" in refused("http://cdn.example/png", pol)


def test_redirect_to_file_or_data_is_refused(network, server):
    assert "scheme 'file'" in refused("http://media.example/redirect?file:///etc/passwd", policy(allow_http=True))


def test_more_than_five_redirects(network, server):
    message = refused("http://media.example/loop/0", policy(allow_http=True))
    assert "more than 5 redirects" in message
    assert len(network) == 6


def test_a_5_gb_body_stops_at_the_cap(network, server):
    started = time.monotonic()
    message = refused("http://media.example/huge", policy(allow_http=True))
    assert "5,368,709,120 bytes, more than the 20,971,520 allowed" in message
    unbounded = refused("http://media.example/endless", policy(allow_http=True, max_image_bytes=1 << 20))
    assert "more than the 1,048,576 bytes allowed" in unbounded
    assert time.monotonic() - started < 5
    assert server.bytes_sent < 64 << 20  # the server was not read on


def test_a_slow_drip_body_hits_the_total_timeout(network, server):
    pol = policy(allow_http=True, total_timeout_s=1.5, read_timeout_s=1.2)
    started = time.monotonic()
    message = refused("http://media.example/drip", pol)
    elapsed = time.monotonic() - started
    assert "took longer than the 1.5 s allowed" in message
    assert 1.4 < elapsed < 4.0


def test_http_errors_and_compressed_bodies(network, server):
    assert "HTTP 404" in refused("http://media.example/missing", policy(allow_http=True))
    assert "compressed" in refused("http://media.example/gzip", policy(allow_http=True))


def test_connect_failure_names_only_the_host(network):
    message = refused("http://unreachable.example/png",
                      policy(allow_http=True, resolver=fake_resolver({"unreachable.example": ["93.184.216.99"]})))
    assert "host unreachable.example" in message and "93.184" not in message


# -- https: SNI and certificate name are the URL's host, the connection the pinned address -----------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    path = tmp_path_factory.mktemp("tls")
    key, cert = str(path / "key.pem"), str(path / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=media.example", "-addext", "subjectAltName=DNS:media.example"],
                   check=True, capture_output=True)
    return key, cert


def test_https_verifies_the_url_name_on_the_pinned_address(certificate, monkeypatch):
    key, cert = certificate
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)
    client_context = ssl.create_default_context(cafile=cert)
    with MediaServer(server_context) as server:
        seen = []
        monkeypatch.setattr(fetch, "make_transport", lambda p: PinnedToLoopback(
            {PUBLIC_IP: server.port, PUBLIC_IP_2: server.port}, seen, verify=client_context))
        assert asyncio.run(fetch_media("https://media.example/png", policy())) == png_bytes()
        assert seen == [(PUBLIC_IP, None, "media.example", "media.example")]
        # The same certificate for another name: the check is against the URL's name, so it fails.
        message = refused("https://cdn.example/png", policy())
        assert "failed (connection, TLS or protocol error)" in message


# -- data: and file:// ---------------------------------------------------------------------------------


def test_data_urls():
    import base64

    pol = MediaFetchPolicy(max_image_bytes=1000)
    small = base64.b64encode(b"x" * 900).decode()
    assert fetch_media_sync(f"data:image/png;base64,{small}", pol) == b"x" * 900
    huge = "data:image/png;base64," + "A" * (200 << 20)  # 200 MB of base64
    started = time.monotonic()
    message = refused(huge, pol)
    assert "more than the 1,000 bytes allowed for an image" in message and time.monotonic() - started < 1
    assert "more than the 1,000 bytes" in refused("data:image/png;base64," + base64.b64encode(b"x" * 1001).decode(), pol)
    assert "not valid base64" in refused("data:image/png;base64,@@@@", pol)
    assert "declares type 'text/html'" in refused(f"data:text/html;base64,{small}", pol)
    assert "no ','" in refused("data:image/png;base64", pol)


def test_file_urls(tmp_path):
    assert "file:// URLs are refused" in refused("file:///etc/passwd", MediaFetchPolicy())
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(png_bytes())
    os.symlink("/etc/passwd", root / "out.png")
    os.symlink(root / "a.png", root / "in.png")
    pol = MediaFetchPolicy(allowed_local_path=str(root))
    assert fetch_media_sync(f"file://{root}/a.png", pol) == png_bytes()
    assert fetch_media_sync(f"file://{root}/in.png", pol) == png_bytes()
    assert "outside --allowed-local-media-path" in refused("file:///etc/passwd", pol)
    assert "outside --allowed-local-media-path" in refused(f"file://{root}/out.png", pol)
    assert "outside --allowed-local-media-path" in refused(f"file://{root}/../../etc/passwd", pol)
    assert "no readable file" in refused(f"file://{root}/none.png", pol)
    assert "not name a regular file" in refused(f"file://{root}", pol)
    os.mkfifo(root / "fifo")
    assert "not name a regular file" in refused(f"file://{root}/fifo", pol)
    (root / "big.png").write_bytes(b"\0" * 2000)
    assert "2,000 bytes, more than the 1,000" in refused(f"file://{root}/big.png",
                                                       MediaFetchPolicy(allowed_local_path=str(root), max_image_bytes=1000))


def test_policy_from_engine_args(tmp_path):
    from metrale.config.engine_args import EngineArgs

    args = EngineArgs(allowed_media_domains="A.example., b.example", media_fetch_timeout=2.0,
                      allowed_local_media_path=str(tmp_path))
    pol = MediaFetchPolicy.from_engine_args(args)
    assert pol.allowed_domains == ("a.example", "b.example") and pol.total_timeout_s == 2.0
    assert pol.connect_timeout_s == 2.0 and not pol.allow_http and not pol.allow_private_addresses
    assert pol.allowed_local_path == os.path.realpath(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        MediaFetchPolicy.from_engine_args(EngineArgs(allowed_local_media_path=str(tmp_path / "none")))
    with pytest.raises(ValueError, match="media_fetch_timeout"):
        EngineArgs(media_fetch_timeout=0)
