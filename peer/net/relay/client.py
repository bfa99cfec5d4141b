"""A peer behind NAT: reservations on relays (renewed, re-made when the connection to a relay
closes), and the STOP side that turns a relay's circuit into an inbound connection through the
node's `InboundGate`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.abc import IMuxedConn, INetStream
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, StopMessage
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from multiaddr import Multiaddr

from peer.errors import ConfigError, Unreachable
from peer.net.host import Node, parse_multiaddr
from peer.net.inbound import InboundGate, InboundLimits
from peer.net.relay.internals import CircuitPipe, circuit_raw_conn, live_conn, mark_relayed
from peer.net.relay.wire import (
    CLOSE_SECONDS,
    HOP_PROTOCOL,
    MESSAGE_ERRORS,
    STOP_PROTOCOL,
    RelayRefused,
    check_status,
    relayed_addr,
    reset_stream,
    stream_source,
)
from peer.net.rpc import TRANSPORT_ERRORS

log = logging.getLogger("peertrain.relay")


@dataclass(frozen=True, kw_only=True)
class RelayClientConfig:
    """How a peer behind NAT keeps its relay reservations."""

    retry_seconds: float = 10.0
    """Pause before trying a relay again after a failure (it restarts, it is full)."""
    message_seconds: float = 10.0
    """Seconds for a reservation or an incoming STOP request to complete."""
    max_pending_circuits: int = 16
    """Incoming circuits per relay still in their STOP exchange."""


@dataclass(frozen=True)
class Reserved:
    """A slot held on a relay."""

    addr: str
    """Our relayed address through it, to advertise."""
    expire: float
    """Unix time at which the relay drops it unless renewed."""
    muxed_conn: IMuxedConn = field(repr=False)
    """Our connection to the relay: the slot ends with it."""


async def reserve(node: Node, relay_id: ID, transport: Multiaddr, *, timeout: float) -> Reserved:
    """Reserve (or renew) a slot on a relay, connecting to it first if need be. Raises
    Unreachable (RelayRefused when the relay said no)."""
    network: Any = node.host.get_network()
    try:
        with trio.fail_after(timeout):
            conn = live_conn(network, relay_id)
            if conn is None:
                await node.connect(relay_id, [transport], timeout=timeout)
                conn = live_conn(network, relay_id)
                if conn is None:
                    raise Unreachable(f"connection to relay {relay_id} closed at once")
            stream = await node.host.new_stream(relay_id, [HOP_PROTOCOL])
            try:
                await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                reply = await read_delimited_msg(stream, HopMessage)
            finally:
                await reset_stream(stream)
    except trio.TooSlowError:
        raise Unreachable(f"no reservation from relay {relay_id} within {timeout:.3g}s") from None
    except MESSAGE_ERRORS as error:
        raise Unreachable(f"reservation on relay {relay_id} failed: {error!r}") from error
    check_status(reply.type == HopMessage.STATUS, reply.status, f"relay {relay_id}")
    expire = float(reply.reservation.expire) if reply.HasField("reservation") else 0.0
    if expire <= time.time():
        raise RelayRefused(
            f"relay {relay_id} gave a reservation without a future expiry",
            StatusCode.MALFORMED_MESSAGE,
        )
    return Reserved(relayed_addr(relay_id, transport, node.peer_id), expire, conn.muxed_conn)


@dataclass(frozen=True)
class RelayClientStatistics:
    reserved: tuple[str, ...]
    """Relay ids we hold a slot on."""
    inbound_circuits: int
    refused_circuits: int


class RelayClient:
    """Keeps reservations on `relays` (full multiaddrs with /p2p/<id>) and accepts the
    circuits they bring; `run` inside the owner's nursery."""

    def __init__(
        self, node: Node, relays: Sequence[str], config: RelayClientConfig | None = None
    ) -> None:
        self.node = node
        self.config = config or RelayClientConfig()
        self.relays: list[tuple[ID, Multiaddr]] = []
        for text in relays:
            maddr = parse_multiaddr(text, what="relay address")
            try:
                relay_id = ID.from_base58(maddr.value_for_protocol("p2p"))
            except Exception:  # no /p2p part, or not a peer id
                raise ConfigError(
                    f"relay address {text!r} has no /p2p/<peer id> part; copy the full "
                    "address a backbone prints"
                ) from None
            self.relays.append((relay_id, maddr.decapsulate(Multiaddr(f"/p2p/{relay_id}"))))
        self.gate: InboundGate = node.inbound or InboundGate(InboundLimits())
        self._held: dict[ID, Reserved] = {}
        self._changed = trio.Event()
        self._stopping: dict[ID, int] = {}
        self._inbound = self._refused = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        host = self.node.host
        host.set_stream_handler(STOP_PROTOCOL, self._handle_stop)
        try:
            async with trio.open_nursery() as nursery:
                for relay_id, transport in self.relays:
                    nursery.start_soon(self._keep, relay_id, transport)
                task_status.started()
        finally:
            host.remove_stream_handler(STOP_PROTOCOL)

    def relayed_addrs(self) -> list[str]:
        """Addresses to advertise: one per relay we hold a live slot on."""
        return [held.addr for held in self._held.values()]

    async def wait_changed(self) -> None:
        """Until a slot is gained or lost (`relayed_addrs()` changed)."""
        await self._changed.wait()

    async def wait_reserved(self, count: int = 1) -> None:
        """Until slots are held on `count` relays."""
        while len(self._held) < count:
            await self._changed.wait()

    def statistics(self) -> RelayClientStatistics:
        return RelayClientStatistics(
            tuple(str(r) for r in self._held), self._inbound, self._refused
        )

    def _set(self, relay_id: ID, held: Reserved | None) -> None:
        if held is None:
            self._held.pop(relay_id, None)
        else:
            self._held[relay_id] = held
        self._changed.set()
        self._changed = trio.Event()

    async def _keep(self, relay_id: ID, transport: Multiaddr) -> None:
        """Hold a slot on one relay: renew at half its lifetime, re-reserve when the connection
        that holds it closes (at once, unless it lasted less than `retry_seconds`), back off
        `retry_seconds` after a failure."""
        while True:
            try:
                held = await reserve(
                    self.node, relay_id, transport, timeout=self.config.message_seconds
                )
            except Unreachable as error:
                log.info("no reservation on relay %s: %s", relay_id, error)
                self._set(relay_id, None)
                await trio.sleep(self.config.retry_seconds)
                continue
            self._set(relay_id, held)
            began = trio.current_time()
            renew_in = max(1.0, (held.expire - time.time()) / 2)
            with trio.move_on_after(renew_in):
                await held.muxed_conn.event_closed.wait()  # type: ignore[attr-defined]
            if held.muxed_conn.is_closed:
                log.info("connection to relay %s closed; reserving again", relay_id)
                self._set(relay_id, None)
                if trio.current_time() - began < self.config.retry_seconds:
                    # A relay that closes every slot at once must not get a dial a moment.
                    await trio.sleep(self.config.retry_seconds)

    async def _handle_stop(self, stream: INetStream) -> None:
        """A relay brings a circuit: only from a relay we hold a slot on, through our gate."""
        relay_id = stream.muxed_conn.peer_id
        busy = self._stopping.get(relay_id, 0)
        if relay_id not in self._held or busy >= self.config.max_pending_circuits:
            self._refused += 1
            await reset_stream(stream)
            return
        self._stopping[relay_id] = busy + 1
        try:
            with trio.fail_after(self.config.message_seconds):
                msg = await read_delimited_msg(stream, StopMessage)
            initiator = ID(msg.peer.id)
            # The relay names the initiator: bytes that are no peer id made building this
            # address raise outside every handler, and the swarm's task manager then stopped
            # the whole node (found in review).
            circuit = Multiaddr(f"/p2p/{relay_id}/p2p-circuit/p2p/{initiator}")
            ok = msg.type == StopMessage.CONNECT
        except (trio.TooSlowError, *MESSAGE_ERRORS) as error:
            log.debug("no STOP request from relay %s: %r", relay_id, error)
            ok, initiator, circuit = False, relay_id, Multiaddr(f"/p2p/{relay_id}")
        finally:
            self._stopping[relay_id] -= 1
            if not self._stopping[relay_id]:
                del self._stopping[relay_id]
        if not ok:
            self._refused += 1
            await reset_stream(stream)
            return
        await self._accept(stream, initiator, circuit)

    async def _accept(self, stream: INetStream, initiator: ID, circuit: Multiaddr) -> None:
        """One relayed inbound connection, as `inbound.serve_inbound` serves a direct one:
        a pending slot of the gate (source: the relay's address), the swarm's inbound
        upgrade (network key, Noise, yamux; bounded by its handshake deadline), then an
        established slot that may be pruned like any other."""
        gate = self.gate
        admission, evicted = gate.admit(stream_source(stream), now=trio.current_time())
        for victim in evicted:
            victim.close()
        if admission is None:
            self._refused += 1
            await self._stop_status(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED)
            await reset_stream(stream)
            return
        pipe = CircuitPipe(stream)
        admission.close = pipe.abort
        network: Any = self.node.host.get_network()
        try:
            if not await self._stop_status(stream, StatusCode.OK):
                return
            raw = circuit_raw_conn(pipe, initiator=False, circuit=circuit)
            try:
                muxed = await network.upgrade_inbound_raw_conn(raw, circuit)
            except Exception as error:  # what py-libp2p's own handler does: a failed peer
                log.debug("relayed connection from %s failed: %r", initiator, error)
                return
            self._inbound += 1
            await self._serve(network, admission, muxed, circuit)
        finally:
            gate.release(admission)
            await reset_stream(stream)

    async def _serve(
        self, network: Any, admission: Any, muxed: IMuxedConn, circuit: Multiaddr
    ) -> None:
        conn = next(
            (c for c in network.connections.get(muxed.peer_id, ()) if c.muxed_conn is muxed), None
        )
        mark_relayed(conn, muxed, circuit, network=network, inbound=True)
        with trio.CancelScope() as pruned:
            admission.close = pruned.cancel
            room = network.connection_config.max_connections - len(network.get_connections())
            victims = self.gate.authenticate(
                admission, peer_id=muxed.peer_id, now=trio.current_time(), room=room
            )
            for victim in victims:
                victim.close()
            await muxed.event_closed.wait()  # type: ignore[attr-defined]
        if pruned.cancelled_caught:
            with trio.move_on_after(CLOSE_SECONDS), suppress(Exception):
                await (conn.close() if conn is not None else muxed.close())

    async def _stop_status(self, stream: INetStream, code: StatusCode) -> bool:
        try:
            with trio.fail_after(self.config.message_seconds):
                await write_delimited_msg(
                    stream,
                    StopMessage(type=StopMessage.STATUS, status=int(code)),  # type: ignore[arg-type]
                )
        except (trio.TooSlowError, *TRANSPORT_ERRORS):
            return False
        return True
