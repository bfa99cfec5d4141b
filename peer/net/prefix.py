"""The network prefix a per-source limit counts, pure.

Addresses are nearly free inside one network: a host on a /24 (a campus, a cloud subnet, a
carrier-grade NAT pool) can take many of its addresses, and an IPv6 host is given a whole /64.
Limits keyed on the exact address let one such host take as many slots as it has addresses,
so every per-source limit (libp2p handshakes, data ports, the dashboard, metrics, dial-back
checks) counts by `prefix_of`: the IPv4 /24 or the IPv6 /64. An IPv6 address that carries
an IPv4 one counts as that IPv4 address: IPv4-mapped (a dual-stack socket reports IPv4 callers
that way), NAT64's well-known prefix (every IPv4 client behind a translator would otherwise
share one /64), 6to4 (a /48 per IPv4 host: 65,536 /64s each) and Teredo (its client's).
"""

from __future__ import annotations

import functools
import ipaddress

IPV4_PREFIX = 24
IPV6_PREFIX = 64


# Asked at every accept: a flood from a few addresses costs a dictionary lookup each, not the
# ~8 us of parsing (an attacker rotating through more addresses gets the parsing).
@functools.lru_cache(maxsize=4096)
def prefix_of(ip: str) -> str:
    """The prefix `ip` counts under: its IPv4 /24 or IPv6 /64 as CIDR text; an address that
    does not parse (a Unix socket's name, a test's stand-in) counts as itself."""
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])  # a scoped IPv6 address's zone
    except ValueError:
        return ip
    if isinstance(address, ipaddress.IPv6Address):
        address = _embedded_ipv4(address) or address
    length = IPV4_PREFIX if address.version == 4 else IPV6_PREFIX
    return str(ipaddress.ip_network((address, length), strict=False))


NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, NAT64, 6to4, Teredo), if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    return None
