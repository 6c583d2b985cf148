"""fetch_media(url, policy): the bytes of an image or video URL, or a MediaError.

http(s) fetches go one hop at a time, and at every hop (the first and each redirect):
1. the scheme is https (http only with policy.allow_http), the URL carries no credentials, and
   the host is on policy.allowed_domains when that list is set;
2. the host is resolved once, and EVERY address it resolves to must be public unicast
   (addresses.py); one internal address refuses the host, so DNS that answers public and
   private at once cannot choose where we land;
3. the connection goes to that checked address and no other: the request URL names the
   address, the Host header and the TLS SNI / certificate name are the original host, so the
   certificate is still verified against the name the client gave. Nothing resolves the name a
   second time, so DNS rebinding between the check and the connect has nothing to rebind;
4. each hop has its own client: no connection (nor its TLS session for another name) is reused
   across hosts, and proxies and netrc from the environment are ignored (trust_env=False).

Redirects are followed by hand (follow_redirects=False), at most policy.max_redirects. The body
is streamed and stops at the byte cap (a Content-Length over it is refused before reading);
compressed transfer encodings are refused rather than inflated. Connect and read timeouts
bound each wait, and one total timeout bounds the whole fetch, so a server that drips a byte a
second ends at the total. Messages name the URL's host at most, never the address it resolved to.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx

from metrale.multimodal.addresses import is_ip_address, refusal_reason
from metrale.multimodal.errors import MediaError
from metrale.multimodal.fetch_policy import MediaFetchPolicy, normalize_host
from metrale.multimodal.local_media import read_data_url, read_file_url

_REDIRECTS = (301, 302, 303, 307, 308)
_DEFAULT_PORTS = {"http": 80, "https": 443}


def make_transport(policy: MediaFetchPolicy) -> httpx.AsyncBaseTransport:
    """A fresh transport per hop: no pooled connection outlives the hop it was opened for."""
    return httpx.AsyncHTTPTransport(retries=0, limits=httpx.Limits(max_keepalive_connections=0))


async def fetch_media(url: str, policy: MediaFetchPolicy, modality: str = "image") -> bytes:
    """The bytes `url` (https, http if allowed, data:, file:// under the allowed path) holds."""
    scheme = url[:max(0, url.find(":", 0, 16))].lower()  # no copy of a long data: URL
    if scheme == "data":
        return read_data_url(url, modality, policy.max_bytes(modality))
    if scheme == "file":
        return await asyncio.to_thread(read_file_url, url, modality, policy)
    target = _Target.of(url, policy)  # refuses a bad first URL before any timer starts
    try:
        async with asyncio.timeout(policy.total_timeout_s):
            return await _fetch_remote(target, policy, modality)
    except TimeoutError:
        raise MediaError(f"fetching the {modality} from host {target.host} took longer than the "
                         f"{policy.total_timeout_s:g} s allowed") from None


def fetch_media_sync(url: str, policy: MediaFetchPolicy, modality: str = "image") -> bytes:
    """fetch_media for callers without an event loop (LLM.chat); inside a running loop (a
    notebook) it runs on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(fetch_media(url, policy, modality))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="met-media-fetch") as worker:
        return worker.submit(asyncio.run, fetch_media(url, policy, modality)).result()


class _Target:
    """One hop's URL after the checks that need no network: scheme, credentials, allow-list."""

    def __init__(self, url: httpx.URL, host: str, port: int):
        self.url, self.host, self.port = url, host, port

    @classmethod
    def of(cls, text: str | httpx.URL, policy: MediaFetchPolicy) -> "_Target":
        try:
            url = httpx.URL(text)
        except (httpx.InvalidURL, TypeError, ValueError):
            raise MediaError("the media URL is not a valid URL") from None
        scheme = url.scheme
        if scheme not in _DEFAULT_PORTS:
            raise MediaError(f"media URLs of scheme {scheme[:16]!r} are refused; use https, data: or file://")
        if scheme == "http" and not policy.allow_http:
            raise MediaError("plain http media URLs are refused: use https (or start the server with "
                             "--media-allow-http)")
        if url.userinfo:
            raise MediaError("media URLs with credentials (user:password@) are refused")
        host = normalize_host(url.raw_host.decode("ascii", "replace"))
        if not host:
            raise MediaError("the media URL names no host")
        if policy.allowed_domains and host not in policy.allowed_domains:
            raise MediaError(f"host {host} is not in --allowed-media-domains")
        return cls(url, host, url.port or _DEFAULT_PORTS[scheme])

    async def checked_address(self, policy: MediaFetchPolicy) -> str:
        """The one address this hop connects to, after every address of the host passed."""
        literal = is_ip_address(self.host)
        if literal:
            addresses = [self.host]
        else:
            loop = asyncio.get_running_loop()
            addresses = await loop.run_in_executor(None, policy.resolver, self.host, self.port)
            if not addresses:
                raise MediaError(f"host {self.host} does not resolve")
        if not policy.allow_private_addresses:
            for address in addresses:
                reason = refusal_reason(address)
                if reason is not None:
                    what = "is" if literal else "resolves to"
                    raise MediaError(f"host {self.host} {what} a {reason} address, not a public one; refused")
        return addresses[0]


async def _fetch_remote(target: _Target, policy: MediaFetchPolicy, modality: str) -> bytes:
    timeout = httpx.Timeout(connect=policy.connect_timeout_s, read=policy.read_timeout_s,
                            write=policy.read_timeout_s, pool=policy.connect_timeout_s)
    for _hop in range(policy.max_redirects + 1):
        address = await target.checked_address(policy)
        pinned = target.url.copy_with(host=address)
        headers = {"Host": target.url.netloc.decode("ascii"), "Accept-Encoding": "identity",
                   "User-Agent": "met-media-fetcher"}
        extensions = {"sni_hostname": target.host} if target.url.scheme == "https" else {}
        async with httpx.AsyncClient(transport=make_transport(policy), timeout=timeout, follow_redirects=False,
                                     trust_env=False) as client:
            request = client.build_request("GET", pinned, headers=headers, extensions=extensions)
            try:
                response = await client.send(request, stream=True)
                try:
                    if response.status_code in _REDIRECTS:
                        target = _redirected(target, response, policy)
                        continue
                    if response.status_code != 200:
                        raise MediaError(f"host {target.host} answered the {modality} request with HTTP "
                                         f"{response.status_code}")
                    return await _read_capped(response, target.host, modality, policy.max_bytes(modality))
                finally:
                    await response.aclose()
            except httpx.TimeoutException as e:
                step = "connecting to" if isinstance(e, (httpx.ConnectTimeout, httpx.PoolTimeout)) else "reading from"
                limit = policy.connect_timeout_s if step == "connecting to" else policy.read_timeout_s
                raise MediaError(f"{step} host {target.host} timed out ({limit:g} s)") from None
            except httpx.HTTPError:
                # httpx's own words may hold the address: say only what failed.
                raise MediaError(f"fetching the {modality} from host {target.host} failed (connection, TLS or "
                                 f"protocol error)") from None
    raise MediaError(f"fetching the {modality} took more than {policy.max_redirects} redirects; refused")


def _redirected(target: _Target, response: httpx.Response, policy: MediaFetchPolicy) -> _Target:
    location = response.headers.get("location")
    if not location:
        raise MediaError(f"host {target.host} redirected without a Location")
    try:
        url = target.url.join(location)
    except (httpx.InvalidURL, ValueError):
        raise MediaError(f"host {target.host} redirected to an invalid URL") from None
    return _Target.of(url, policy)  # scheme, credentials and allow-list again; the addresses next hop


async def _read_capped(response: httpx.Response, host: str, modality: str, max_bytes: int) -> bytes:
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise MediaError(f"host {host} sent the {modality} compressed ({encoding[:20]}); refused")
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise MediaError(f"the {modality} at host {host} is {int(length):,} bytes, more than the "
                         f"{max_bytes:,} allowed")
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > max_bytes:
            raise MediaError(f"the {modality} at host {host} is more than the {max_bytes:,} bytes allowed")
    if not body:
        raise MediaError(f"host {host} sent an empty {modality}")
    return bytes(body)
