"""The relay (hop) side, on a backbone: reservations bound to the authenticated peer of the
connection they arrive on, and circuits spliced between a dialer and a reserved peer within
the `RelayBook`'s limits."""

from __future__ import annotations

import logging
import time
from contextlib import suppress
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, Limit, Reservation, StopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as PeerIdMessage
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from multiaddr import Multiaddr

from peer.net.host import Node
from peer.net.relay.book import RelayBook, RelayLimits, RelayStatistics
from peer.net.relay.internals import is_relayed
from peer.net.relay.wire import (
    CLOSE_SECONDS,
    HOP_PROTOCOL,
    MESSAGE_ERRORS,
    STOP_PROTOCOL,
    reset_stream,
    stream_source,
)
from peer.net.rpc import TRANSPORT_ERRORS

log = logging.getLogger("peertrain.relay")

PUMP_CHUNK = 64 * 1024


class RelayService:
    """Serves circuit relay v2 hop requests on a node (a backbone)."""

    def __init__(self, node: Node, limits: RelayLimits | None = None) -> None:
        self.node = node
        self.limits = limits or RelayLimits()
        self.book = RelayBook(self.limits)
        self._circuit_scopes: set[trio.CancelScope] = set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        host = self.node.host
        network = host.get_network()
        notifee = _OnDisconnect(lambda conn: self._connection_closed(conn))
        network.register_notifee(notifee)
        host.set_stream_handler(HOP_PROTOCOL, self._handle_hop)
        # A reserved peer's connection is idle between renewals; the gate must not prune it.
        gate = self.node.inbound
        if gate is not None:
            unheld, gate.holds = gate.holds, self._holds
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            host.remove_stream_handler(HOP_PROTOCOL)
            if gate is not None:
                gate.holds = unheld
            notifee.callback = None  # py-libp2p cannot unregister a notifee
            for scope in list(self._circuit_scopes):
                scope.cancel()

    def statistics(self) -> RelayStatistics:
        return self.book.statistics()

    def _holds(self, muxed_conn: object) -> bool:
        return self.book.holds(muxed_conn, now=time.time())

    def _connection_closed(self, conn: Any) -> None:
        for peer in self.book.connection_closed(getattr(conn, "muxed_conn", conn)):
            log.debug("reservation of %s ended with its connection", peer)

    async def _handle_hop(self, stream: INetStream) -> None:
        remote = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(self.limits.message_seconds):
                msg = await read_delimited_msg(stream, HopMessage)
        except (trio.TooSlowError, *MESSAGE_ERRORS) as error:
            log.debug("no hop request from %s: %r", remote, error)
            await reset_stream(stream)
            return
        if is_relayed(stream.muxed_conn):  # the spec: never relay over a relayed connection
            await self._answer(stream, StatusCode.PERMISSION_DENIED)
        elif msg.type == HopMessage.RESERVE:
            await self._reserve(stream, msg)
        elif msg.type == HopMessage.CONNECT:
            await self._connect(stream, msg)
        else:
            await self._answer(stream, StatusCode.UNEXPECTED_MESSAGE)

    async def _reserve(self, stream: INetStream, msg: HopMessage) -> None:
        remote = stream.muxed_conn.peer_id
        # The slot is the authenticated peer's; a RESERVE naming another peer is refused.
        if msg.HasField("peer") and msg.peer.id and msg.peer.id != remote.to_bytes():
            self.book.refused += 1
            await self._answer(stream, StatusCode.PERMISSION_DENIED)
            return
        now = time.time()
        code = self.book.reserve(
            remote, source=stream_source(stream), conn=stream.muxed_conn, now=now
        )
        if code is not StatusCode.OK:
            await self._answer(stream, code)
            return
        me = self.node.peer_id
        reservation = Reservation(
            expire=int(self.book.expiry(remote) or now),
            addrs=[Multiaddr(f"{a}/p2p/{me}").to_bytes() for a in self.node.announce],
        )
        await self._answer(stream, StatusCode.OK, reservation=reservation)
        with trio.move_on_after(CLOSE_SECONDS), suppress(*TRANSPORT_ERRORS):
            await stream.close()

    async def _connect(self, stream: INetStream, msg: HopMessage) -> None:
        src = stream.muxed_conn.peer_id
        try:
            dst = ID(msg.peer.id)
        except Exception:  # py-libp2p raises several types for bad id bytes
            await self._answer(stream, StatusCode.MALFORMED_MESSAGE)
            return
        code, circuit = self.book.open_circuit(
            src, dst, source=stream_source(stream), now=time.time()
        )
        if circuit is None:
            await self._answer(stream, code)
            return
        try:
            dst_stream = await self._stop(src, dst)
            if dst_stream is None:
                await self._answer(stream, StatusCode.CONNECTION_FAILED)
                return
            await self._answer(stream, StatusCode.OK, limit=True)
            await self._splice(stream, dst_stream)
        finally:
            self.book.close_circuit(circuit)

    async def _stop(self, src: ID, dst: ID) -> INetStream | None:
        """A STOP stream to `dst` over the connection its reservation came on, accepted."""
        if self.book.connection_of(dst, now=time.time()) is None:
            return None
        stream = None
        try:
            with trio.fail_after(self.limits.message_seconds):
                stream = await self.node.host.new_stream(dst, [STOP_PROTOCOL])
                await write_delimited_msg(
                    stream,
                    StopMessage(
                        type=StopMessage.CONNECT,
                        peer=PeerIdMessage(id=src.to_bytes()),
                        limit=self._limit(),
                    ),
                )
                reply = await read_delimited_msg(stream, StopMessage)
        except (trio.TooSlowError, *MESSAGE_ERRORS) as error:
            log.debug("STOP to %s failed: %r", dst, error)
            if stream is not None:
                await reset_stream(stream)
            return None
        if reply.type != StopMessage.STATUS or reply.status != StatusCode.OK:
            log.debug("%s refused a circuit from %s: status %s", dst, src, reply.status)
            await reset_stream(stream)
            return None
        return stream

    async def _splice(self, a: INetStream, b: INetStream) -> None:
        budget = [self.limits.circuit_bytes]
        with trio.CancelScope() as scope:
            self._circuit_scopes.add(scope)
            scope.deadline = trio.current_time() + self.limits.circuit_seconds
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, a, b, budget, nursery.cancel_scope)
                    nursery.start_soon(self._pump, b, a, budget, nursery.cancel_scope)
            finally:
                self._circuit_scopes.discard(scope)
                await reset_stream(a)
                await reset_stream(b)
        if scope.cancelled_caught or budget[0] < 0:
            self.book.cut += 1

    @staticmethod
    async def _pump(
        src: INetStream, dst: INetStream, budget: list[int], circuit: trio.CancelScope
    ) -> None:
        """Copy src to dst until EOF (then half-close dst); any failure, or going past the
        circuit's byte budget (shared by both directions), ends the whole circuit."""
        try:
            while True:
                try:
                    data = await src.read(PUMP_CHUNK)
                except EOFError:
                    data = b""
                if not data:
                    await dst.close_write()  # type: ignore[attr-defined]
                    return
                budget[0] -= len(data)
                if budget[0] < 0:
                    log.debug("circuit cut at its byte limit")
                    break
                await dst.write(data)
        except TRANSPORT_ERRORS as error:
            log.debug("circuit ended: %r", error)
        circuit.cancel()

    async def _answer(
        self,
        stream: INetStream,
        code: StatusCode,
        *,
        reservation: Reservation | None = None,
        limit: bool = False,
    ) -> None:
        reply = HopMessage(type=HopMessage.STATUS, status=int(code))  # type: ignore[arg-type]
        if reservation is not None:
            reply.reservation.CopyFrom(reservation)
        if reservation is not None or limit:
            reply.limit.CopyFrom(self._limit())
        try:
            with trio.fail_after(self.limits.message_seconds):
                await write_delimited_msg(stream, reply)
        except (trio.TooSlowError, *TRANSPORT_ERRORS):
            await reset_stream(stream)
            return
        if code is not StatusCode.OK:
            with trio.move_on_after(CLOSE_SECONDS), suppress(*TRANSPORT_ERRORS):
                await stream.close()

    def _limit(self) -> Limit:
        return Limit(duration=self.limits.circuit_seconds, data=self.limits.circuit_bytes)


class _OnDisconnect:
    """A notifee that reports closed connections (py-libp2p keeps notifees forever, so the
    owner clears `callback` when it stops)."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    async def disconnected(self, network: Any, conn: Any) -> None:
        if self.callback is not None:
            self.callback(conn)

    async def connected(self, network: Any, conn: Any) -> None:
        pass

    async def opened_stream(self, network: Any, stream: Any) -> None:
        pass

    async def closed_stream(self, network: Any, stream: Any) -> None:
        pass

    async def listen(self, network: Any, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: Any, multiaddr: Multiaddr) -> None:
        pass
