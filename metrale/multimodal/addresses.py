"""Which addresses the media fetcher may connect to: public unicast ones only.

`ipaddress`'s `is_global` alone is not enough: in Python 3.11 it calls multicast, 6to4 and the
site-local range global, and it does not look inside IPv6 forms that carry an IPv4 address. So
every category is checked by name, and an IPv6 address that embeds an IPv4 one (mapped
::ffff:a.b.c.d, compatible ::a.b.c.d, 6to4 2002:aabb:ccdd::, NAT64 64:ff9b::a.b.c.d and the
local-use 64:ff9b:1::/48, Teredo's client) is refused when the embedded address would be.
"""

from __future__ import annotations

import ipaddress

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_COMPATIBLE = ipaddress.ip_network("::/96")
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: not private by name, not public


def _category(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The reason this address is not public unicast, or None when it is."""
    checks = (("loopback", ip.is_loopback), ("unspecified", ip.is_unspecified),
              ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
              ("private", ip.is_private), ("reserved", ip.is_reserved),
              ("site-local", getattr(ip, "is_site_local", False)),
              ("shared (carrier-grade NAT)", ip.version == 4 and ip in _SHARED),
              ("not globally routable", not ip.is_global))
    return next((name for name, hit in checks if hit), None)


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    found = [a for a in (ip.ipv4_mapped, ip.sixtofour) if a is not None]
    if ip.teredo is not None:
        found.append(ip.teredo[1])
    if ip in _NAT64 or ip in _COMPATIBLE:
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return found


def is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    return True


def refusal_reason(address: str) -> str | None:
    """Why the fetcher must not connect to `address` (e.g. "loopback"), or None when it may.
    Text that is not an address is refused too."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone id names a link: link-local anyway
    except ValueError:
        return "not an IP address"
    if ip.version == 4:
        return _category(ip)
    if ip in _NAT64_LOCAL:
        return "NAT64 local-use"
    inner = next((reason for reason in map(_category, _embedded_ipv4(ip)) if reason), None)
    if ip in _NAT64 or ip.sixtofour is not None:
        return inner  # a translation prefix is as public as the IPv4 address it carries
    own = _category(ip)
    return own if own in ("loopback", "unspecified") else inner or own  # ::1 and :: are not wrappers
