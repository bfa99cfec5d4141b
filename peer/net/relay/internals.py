"""The py-libp2p internals relayed connections are built from (pinned libp2p==0.8.1), checked
at import: a circuit's stream wrapped as the raw connection the swarm's upgrades take, the
mark that a connection is relayed, and a live connection looked up in the swarm."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import trio
from libp2p.abc import IMuxedConn, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.io.exceptions import IOException
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.protocol_muxer.multiselect_client import MultiselectClient
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.security.pnet.protector import new_protected_conn
from multiaddr import Multiaddr

from peer.net.relay.wire import reset_stream


def _require_libp2p() -> None:
    """We build relayed connections from py-libp2p parts that are not its public API (pinned
    libp2p==0.8.1): fail at import, not in the middle of a dial, if they moved."""
    import libp2p

    wanted = {
        "libp2p version": getattr(libp2p, "__version__", None) == "0.8.1",
        "Swarm.upgrade_outbound_raw_conn": hasattr(Swarm, "upgrade_outbound_raw_conn"),
        "Swarm.upgrade_inbound_raw_conn": hasattr(Swarm, "upgrade_inbound_raw_conn"),
        "RawConnection(connection_type=, addresses=)": {"connection_type", "addresses"}
        <= set(RawConnection.__init__.__code__.co_varnames),
    }
    missing = [name for name, ok in wanted.items() if not ok]
    if missing:
        raise ImportError(f"peer.net.relay needs libp2p==0.8.1 internals; changed: {missing}")


_require_libp2p()

# Connections made through a relay, at either end, and whether the remote dialed it (we
# accepted its STOP). py-libp2p's own marker (ConnectionType) is lost under a network key: its
# PskConn never sets the attributes it inherits.
_relayed: weakref.WeakKeyDictionary[IMuxedConn, bool] = weakref.WeakKeyDictionary()


# Who wants to hear of new relayed connections, per swarm (peer.net.holepunch): called with
# (peer id, inbound), synchronously; a watcher starts its own task.
_watchers: weakref.WeakKeyDictionary[Any, list[Callable[[ID, bool], None]]] = (
    weakref.WeakKeyDictionary()
)


def watch_relayed(network: Any, callback: Callable[[ID, bool], None]) -> Callable[[], None]:
    """Call `callback(peer_id, inbound)` for every relayed connection made from now on in
    `network` (inbound: the remote dialed us through a relay). Returns the unsubscribe."""
    _watchers.setdefault(network, []).append(callback)

    def unwatch() -> None:
        with suppress(KeyError, ValueError):
            _watchers[network].remove(callback)

    return unwatch


def mark_relayed(
    swarm_conn: Any,
    muxed_conn: IMuxedConn,
    circuit: Multiaddr,
    *,
    network: Any = None,
    inbound: bool = False,
) -> None:
    """Remember a relayed connection, and tell py-libp2p too: without the tag, under a
    network key its DCUtR took a relayed connection for a direct one and never punched.
    Watchers of `network` (see `watch_relayed`) hear of it. `inbound`: the remote dialed it
    (we accepted the circuit's STOP), as opposed to our CONNECT through the relay."""
    _relayed[muxed_conn] = inbound
    if swarm_conn is not None:
        swarm_conn.set_transport_info([circuit], ConnectionType.RELAYED)
    for callback in list(_watchers.get(network, ())) if network is not None else ():
        callback(muxed_conn.peer_id, inbound)


# Relayed connections whose hole punch ended (True: a direct one was made), set by
# `peer.net.holepunch`: a data plane waiting for a punch on one stops once it failed.
_punched: weakref.WeakKeyDictionary[IMuxedConn, bool] = weakref.WeakKeyDictionary()


def note_punch(network: Any, peer_id: ID, direct: bool) -> None:
    """Record how the hole punch over our relayed connections to `peer_id` ended."""
    for conn in network.connections.get(peer_id, ()):
        if is_relayed(conn.muxed_conn):
            _punched[conn.muxed_conn] = direct


def punch_failed(network: Any, peer_id: ID) -> bool:
    """A hole punch over an open relayed connection to `peer_id` ended without a direct one
    (nothing is retried until a new relayed connection is made)."""
    return any(
        _punched.get(conn.muxed_conn) is False
        for conn in network.connections.get(peer_id, ())
        if is_relayed(conn.muxed_conn) and not conn.muxed_conn.is_closed
    )


def direct_conn(network: Any, peer_id: ID) -> Any | None:
    """The swarm's open connection to `peer_id` that does not run through a relay, if any."""
    for conn in network.connections.get(peer_id, ()):
        if not conn.muxed_conn.is_closed and not is_relayed(conn.muxed_conn):
            return conn
    return None


async def stream_on(conn: Any, protocol: str, *, timeout: float) -> INetStream:
    """A new stream of `protocol` on exactly `conn` (a swarm connection): `host.new_stream`
    picks any connection to the peer, a relayed one too. Multistream-select as the host does
    it; the stream is reset if that fails."""
    with trio.fail_after(timeout):  # yamux may hold a new stream back (its backlog)
        stream = await conn.new_stream()
    try:
        with trio.fail_after(timeout):
            chosen = await MultiselectClient().select_one_of(
                [protocol], MultiselectCommunicator(stream), max(1, int(timeout))
            )
    except BaseException:
        await reset_stream(stream)
        raise
    stream.set_protocol(chosen)
    return stream


def is_relayed(muxed_conn: IMuxedConn) -> bool:
    """Whether a connection runs through a relay (limited: control traffic only)."""
    return muxed_conn in _relayed


def relayed_inbound(muxed_conn: IMuxedConn) -> bool | None:
    """Who dialed a relayed connection: True if the remote did (we accepted its STOP, see
    `peer.net.relay.client`), False if we did (our CONNECT, `peer.net.relay.dial`); None for
    a connection not (yet) marked relayed. Set by us, not read from the remote's handshake."""
    return _relayed.get(muxed_conn)


def live_conn(network: Any, peer_id: ID) -> Any | None:
    """The swarm's open connection to `peer_id`, if any."""
    for conn in network.connections.get(peer_id, ()):
        if not conn.muxed_conn.is_closed:
            return conn
    return None


def circuit_raw_conn(pipe: Any, *, initiator: bool, circuit: Multiaddr) -> RawConnection:
    """A circuit (a hop or STOP stream) as the raw connection the swarm's upgrades take."""
    return RawConnection(pipe, initiator, ConnectionType.RELAYED, [circuit])


async def upgrade_outbound(network: Any, stream: INetStream, circuit: Multiaddr, target: ID) -> Any:
    """The dialer's end of a circuit: network key, Noise expecting `target`, yamux; the
    connection joins the swarm. Returns the swarm's connection."""
    raw: Any = circuit_raw_conn(stream, initiator=True, circuit=circuit)
    psk = network.psk  # what Swarm.dial wraps a direct connection in; its upgrade does not
    if psk is not None:
        raw = new_protected_conn(raw, psk)
    return await network.upgrade_outbound_raw_conn(raw, target)


class CircuitPipe:
    """The STOP stream as the raw connection the inbound upgrade reads. `abort()` (the gate
    evicting a pending handshake) fails its reads and writes instead of cancelling the
    upgrade: py-libp2p's upgrade then cleans up as for any broken connection (a cancellation
    would skip its resource-manager release, see `peer.net.inbound`)."""

    def __init__(self, stream: INetStream) -> None:
        self.stream = stream
        self._scopes: set[trio.CancelScope] = set()
        self._aborted = False

    def abort(self) -> None:
        self._aborted = True
        for scope in self._scopes:
            scope.cancel()

    async def _io(self, op: Any, *args: Any) -> Any:
        if self._aborted:
            raise IOException("relayed connection aborted")
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                return await op(*args)
            finally:
                self._scopes.discard(scope)
        raise IOException("relayed connection aborted")

    async def read(self, n: int | None = None) -> bytes:
        return await self._io(self.stream.read, n)  # type: ignore[no-any-return]

    async def write(self, data: bytes) -> None:
        await self._io(self.stream.write, data)

    async def close(self) -> None:
        await reset_stream(self.stream)

    def get_remote_address(self) -> tuple[str, int] | None:
        return self.stream.get_remote_address()  # type: ignore[attr-defined,no-any-return]
