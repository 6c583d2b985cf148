"""The address rules of the media fetcher: public unicast only, IPv6 wrappers of IPv4 unwrapped."""

from __future__ import annotations

import pytest

from metrale.multimodal.addresses import refusal_reason

REFUSED = {
    "127.0.0.1": "loopback", "127.8.9.10": "loopback", "::1": "loopback", "0.0.0.0": "unspecified", "::": "unspecified",
    "10.0.0.1": "private", "172.16.5.4": "private", "192.168.1.1": "private", "fd00::1": "private",
    "169.254.169.254": "link-local", "fe80::1": "link-local", "fe80::1%eth0": "link-local",
    "224.0.0.1": "multicast", "ff02::1": "multicast", "240.0.0.1": "private", "255.255.255.255": "private",
    "100.64.0.1": "shared (carrier-grade NAT)", "fec0::1": "site-local", "192.0.2.1": "private",
    "2001:db8::1": "private",
    # IPv6 forms that carry an IPv4 address
    "::ffff:127.0.0.1": "loopback", "::ffff:10.1.1.1": "private", "::127.0.0.1": "loopback",
    "2002:7f00:1::": "loopback", "2002:a9fe:a9fe::": "link-local", "64:ff9b::7f00:1": "loopback",
    "64:ff9b::a00:1": "private", "64:ff9b:1::1": "NAT64 local-use",
    "2001:0:4136:e378:8000:63bf:3fff:fdd2": "private",  # Teredo
    "not-an-address": "not an IP address",
}


@pytest.mark.parametrize("address,reason", sorted(REFUSED.items()))
def test_refused(address, reason):
    assert refusal_reason(address) == reason


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.216.34", "2606:4700::1111", "2002:808:808::",
                                     "64:ff9b::808:808"])
def test_public(address):
    assert refusal_reason(address) is None
