"""Relayed addresses other peers announce, checked before anything is dialed (pure).

`/ip4/R/tcp/P/p2p/<relay>/p2p-circuit/p2p/<target>` says "reach <target> through <relay>". Such
an address arrives in records (presence, progress, tickets) that anyone can write, so, as
`peer.net.admission.check_dial_address` does for direct addresses:
- the relay must be one of *our* relays (the backbones this node was configured with): a
  record cannot make us dial a relay of its choosing, nor hand our connection attempts to a
  third party;
- the relay's transport address is the one *we* know for it, never the one in the record
  (a record naming our backbone's id at another address would otherwise replace the
  backbone's address in our peerstore, or make us dial that address);
- the target must be the peer the record belongs to (Noise then proves it inside the circuit).

Lives outside `peer.net.relay` so that `peer.net.host` can use it without an import cycle.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from libp2p.peer.id import ID
from multiaddr import Multiaddr

from peer.errors import ConfigError

CIRCUIT = "/p2p-circuit"
MAX_PER_PEER = 4
MAX_PEERS = 4096


def is_circuit(addr: str | Multiaddr) -> bool:
    """Whether an address goes through a relay."""
    return CIRCUIT in str(addr)


def parse_relayed_addr(text: str | Multiaddr) -> tuple[ID, Multiaddr, ID]:
    """`/ip4/R/tcp/P/p2p/<relay>/p2p-circuit/p2p/<target>` -> (relay id, relay's transport
    address, target id); ConfigError for anything else."""
    relay_part, sep, target_part = str(text).partition(CIRCUIT)
    try:
        relay = Multiaddr(relay_part)
        relay_id = ID.from_base58(relay.value_for_protocol("p2p"))
        target = ID.from_base58(Multiaddr(target_part).value_for_protocol("p2p"))
        transport = relay.decapsulate(Multiaddr(f"/p2p/{relay_id}"))
    except Exception:  # the multiaddr package and ID raise several unrelated types
        sep = ""
    if not sep or not str(transport) or str(target_part) != f"/p2p/{target}":
        raise ConfigError(
            f"relayed address {str(text)[:200]!r} is not of the form "
            "/ip4/<relay ip>/tcp/<port>/p2p/<relay id>/p2p-circuit/p2p/<peer id>"
        )
    return relay_id, transport, target


def relayed_addr(relay_id: ID, relay_addr: Multiaddr, target: ID) -> str:
    return f"{relay_addr}/p2p/{relay_id}/p2p-circuit/p2p/{target}"


class RelayedAddrError(ValueError):
    """A relayed address from another peer that we will not dial (shows the value)."""


def check_relayed_addr(
    text: str | Multiaddr, *, peer_id: ID, relays: Mapping[ID, Multiaddr]
) -> str:
    """The relayed address to dial for `text`, found in a record of `peer_id`: rebuilt with
    our own address of the relay. RelayedAddrError unless it parses, its relay is one of
    `relays` (id -> the transport address we know), and its target is `peer_id` and none of
    them."""
    try:
        relay_id, _, target = parse_relayed_addr(text)
    except ConfigError as error:
        raise RelayedAddrError(str(error)) from None
    if target != peer_id:
        raise RelayedAddrError(
            f"relayed address {str(text)[:200]!r} names target {target}, not {peer_id}"
        )
    if target in relays:  # a backbone is dialled directly: never through itself or another
        raise RelayedAddrError(f"relayed address {str(text)[:200]!r} names a backbone as target")
    known = relays.get(relay_id)
    if known is None:
        raise RelayedAddrError(
            f"relayed address {str(text)[:200]!r} goes through {relay_id}, which is not one "
            "of our backbones"
        )
    return relayed_addr(relay_id, known, target)


class RelayedBook:
    """The relayed addresses learned for other peers, checked against our relays; bounded
    (`MAX_PER_PEER` each, the `MAX_PEERS` most recently told)."""

    def __init__(self, relays: Mapping[ID, Multiaddr] | None = None) -> None:
        self.relays: dict[ID, Multiaddr] = dict(relays or {})
        """Our relays: relay id -> the transport address we dial it at."""
        self._by_peer: OrderedDict[ID, list[str]] = OrderedDict()
        self.refused = 0
        """Relayed addresses dropped by `check_relayed_addr`."""

    def learn(self, peer_id: ID, addrs: Iterable[str | Multiaddr]) -> list[str]:
        """Keep the acceptable relayed addresses among `addrs` (they replace what was known
        for `peer_id`: a peer that stopped reserving stops announcing them). Returns them."""
        good: list[str] = []
        for addr in addrs:
            try:
                checked = check_relayed_addr(addr, peer_id=peer_id, relays=self.relays)
            except RelayedAddrError:
                self.refused += 1
                continue
            if checked not in good:
                good.append(checked)
        if good:
            self._by_peer[peer_id] = good[:MAX_PER_PEER]
            self._by_peer.move_to_end(peer_id)
            while len(self._by_peer) > MAX_PEERS:
                self._by_peer.popitem(last=False)
        return good

    def addrs_of(self, peer_id: ID) -> list[str]:
        return list(self._by_peer.get(peer_id, ()))

    def forget(self, peer_id: ID, addr: str) -> None:
        """Drop one address (its relay said the peer holds no slot there)."""
        kept = [a for a in self._by_peer.get(peer_id, ()) if a != addr]
        if kept:
            self._by_peer[peer_id] = kept
        else:
            self._by_peer.pop(peer_id, None)
