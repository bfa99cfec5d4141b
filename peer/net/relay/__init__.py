"""Circuit relay v2: a backbone relays control traffic for peers behind NAT.

Theory of operation
-------------------
We speak the circuit relay v2 wire format (libp2p/specs relay/circuit-v2.md: length-delimited
`HopMessage` / `StopMessage` protobufs on `/libp2p/circuit/relay/0.2.0/{hop,stop}`) with our own
code on both ends. py-libp2p 0.8.1 ships both roles, but, read in its source:
- its relay takes the reserving peer id from the message (`msg.peer`), so anyone can hold or
  refresh a slot in another peer's name; reservations outlive the connection until their TTL;
  `_active_relays` is keyed by peer id, so two circuits to one peer tear each other down;
  defaults are 1 GiB / 1 h per circuit;
- its client upgrades a relayed connection without the network key (the pnet wrap lives in
  `Swarm.dial`, not in `upgrade_outbound_raw_conn`), and its STOP side upgrades inbound
  circuits straight through the swarm, past our `InboundGate`;
- `Swarm.dial_peer` skips `/p2p-circuit` addresses, so a relayed peer is dialed explicitly.

Relay (`RelayService`, on a backbone): a reservation belongs to the *authenticated* remote
peer of the connection it arrived on (Noise proved that id; a RESERVE naming anyone else is
refused) and ends when that connection closes, when it expires, or when the service stops.
While it lives, that connection counts as busy to the node's `InboundGate` (pruning it would
only make the peer reserve again). `RelayBook` (synchronous, clock passed in) counts
reservations (in all and per source address) and circuits (in all, per destination and per
source address); a circuit may carry `circuit_bytes` (both directions together) for
`circuit_seconds`, then both halves are reset. Nothing is relayed over a relayed connection.

NATed peer (`RelayClient`): keeps a reservation on each given relay (renewed at half its
lifetime, re-made at once when the connection to the relay closes, retried every
`retry_seconds` while the relay is away), advertises `relayed_addrs()`, and accepts STOP
streams only from relays it holds a slot on. A relayed inbound connection takes a slot of the
node's `InboundGate` exactly like a direct one (its source: the relay's address), then the
swarm's own inbound upgrade applies the network key, Noise and yamux.

Dialer (`dial_via_relay`, any node): CONNECT through the relay, then the network key (pnet),
Noise with the target's peer id *expected* (a relay that answers as anyone else fails the
handshake), yamux; the connection joins the swarm, so `host.new_stream` and our RPC use it.

Modules
-------
- `book`: the relay's limits and bookkeeping (pure).
- `service`: the relay (hop) side.
- `client`: reservations and the STOP side of a peer behind NAT.
- `dial`: dialing a peer through a circuit.
- `keep`: a peer's slots follow its reachability (`RelaySlots`).
- `wire`: what both ends share: status checks, stream resets, relayed addresses.
- `internals`: the py-libp2p internals we build relayed connections from, checked at import.
"""

from __future__ import annotations

from peer.net.relay.book import RelayBook, RelayLimits, RelayStatistics
from peer.net.relay.client import (
    RelayClient,
    RelayClientConfig,
    RelayClientStatistics,
    Reserved,
    reserve,
)
from peer.net.relay.dial import dial_via_relay, route_through_relays
from peer.net.relay.internals import direct_conn, is_relayed, stream_on, watch_relayed
from peer.net.relay.keep import RelaySlots
from peer.net.relay.service import RelayService
from peer.net.relay.wire import RelayRefused, parse_relayed_addr, relayed_addr

__all__ = [
    "RelayBook",
    "RelayClient",
    "RelayClientConfig",
    "RelayClientStatistics",
    "RelayLimits",
    "RelayRefused",
    "RelayService",
    "RelaySlots",
    "RelayStatistics",
    "Reserved",
    "dial_via_relay",
    "direct_conn",
    "is_relayed",
    "parse_relayed_addr",
    "relayed_addr",
    "reserve",
    "route_through_relays",
    "stream_on",
    "watch_relayed",
]
