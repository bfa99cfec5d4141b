"""`peer.net.prefix.prefix_of`: what every per-source limit counts."""

from __future__ import annotations

import pytest

from peer.net.prefix import prefix_of


@pytest.mark.parametrize(
    ("address", "prefix"),
    [
        ("198.51.100.7", "198.51.100.0/24"),
        ("2001:db8::1", "2001:db8::/64"),
        ("fe80::1%eth0", "fe80::/64"),  # a scoped address's zone
        ("::ffff:198.51.100.7", "198.51.100.0/24"),  # IPv4-mapped
        # IPv6 addresses carrying an IPv4 one count as it (review find: every IPv4 client of a
        # NAT64 translator shared one /64, and 6to4 gave each IPv4 host 65,536 of them).
        ("64:ff9b::198.51.100.7", "198.51.100.0/24"),  # NAT64, well-known prefix
        ("2002:c633:6407::1", "198.51.100.0/24"),  # 6to4 of 198.51.100.7
        ("2002:c633:6407:ffff::1", "198.51.100.0/24"),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "192.0.2.0/24"),  # Teredo: its client's
        ("not an address", "not an address"),
    ],
)
def test_the_prefix_an_address_counts_under(address, prefix):
    assert prefix_of(address) == prefix
