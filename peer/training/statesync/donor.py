"""The state donor: `StateDonor` serves a snapshot, manifests over RPC and chunks over TCP
(or, to a downloader with no direct path to us, over a libp2p stream: `peer.net.streamio`)."""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from peer.errors import ProtocolError, RpcError
from peer.net.admission import Admission, AdmissionLimits
from peer.net.host import Node, host_of
from peer.net.ratelimit import ByteBudgets
from peer.net.rpc import RpcServer
from peer.net.streamio import (
    STATE_PROTOCOL,
    DataStream,
    Libp2pStream,
    StreamGate,
    StreamLimits,
)
from peer.net.tls import DataIdentity
from peer.training.chunks import (
    HASH_BYTES,
    MAX_CHUNKS,
    MAX_MEMBERS,
    MAX_PEER_ID_CHARS,
    PIECE_BYTES,
    SERVICE,
    TICKET_BYTES,
    Manifest,
    ManifestRequest,
    Release,
    Released,
    chunk_ends,
    chunk_hash,
    chunk_span,
    donor_chunk_bytes,
    fixed_ends,
)
from peer.training.statesync.wire import (
    CONNECTION_ERRORS,
    HASH_WORKERS,
    KIND_CHUNK,
    KIND_ERROR,
    MAGIC,
    MAX_ERROR_BYTES,
    REPLY,
    REQUEST,
    Sliced,
    Snapshot,
    sliceable,
)

log = logging.getLogger("peertrain.statesync")

SEND_SLICE = 1 << 20  # a stalled receiver is noticed within a slice
MAX_CONNECTIONS_PER_TICKET = 2
TICKET_STATES = 2  # a ticket serves at most this many times the state's bytes
DEFAULT_CHUNK_BYTES = PIECE_BYTES


async def _hash_chunks(
    view: memoryview | Sliced,
    ranges: list[tuple[int, int]],
    known: Mapping[tuple[int, int], bytes],
) -> list[bytes]:
    """`chunk_hash` of every chunk not in `known`, in HASH_WORKERS threads (it releases the
    GIL)."""
    out = [known.get(span, b"") for span in ranges]
    todo = [i for i, digest in enumerate(out) if not digest]
    workers = min(HASH_WORKERS, len(todo))

    def work(first: int) -> None:
        for index in todo[first::workers]:
            start, end = ranges[index]
            out[index] = chunk_hash(view[start:end])

    async with trio.open_nursery() as nursery:
        for first in range(workers):
            nursery.start_soon(functools.partial(trio.to_thread.run_sync, work, first))
    return out


# A manifest must fit one RPC message: 34 bytes per msgpack'd hash and up to 9 per end, plus
# slack for its other fields.
CHUNK_MANIFEST_BYTES = HASH_BYTES + 11
MANIFEST_SLACK = 1024


def fitting(members: Sequence[str], *, room: int) -> list[str]:
    """The electorate's members a manifest can carry: all of them, or none where they are
    more than its schema takes (`MAX_MEMBERS`: a plan of up to 8,192 peers can have more) or
    than the message has room for. A manifest that broke either would fail every download
    of the state; without the list a downloader only loses its first step (review)."""
    size = sum(len(m.encode()) + 3 for m in members)  # msgpack: a str header of 1-3 bytes
    fits = (
        len(members) <= MAX_MEMBERS
        and size <= room
        and all(len(m) <= MAX_PEER_ID_CHARS for m in members)
    )
    return list(members) if fits else []


@dataclass(frozen=True)
class DonorStatistics:
    step: int | None
    """Step of the snapshot whose hashes are cached (None: nothing hashed yet)."""
    downloads: int
    """Live tickets: downloads being served (at most `max_downloads`)."""
    connections: int
    chunks_served: int
    bytes_served: int
    refused: int
    """Manifest requests refused because `max_downloads` were being served."""


@dataclass(frozen=True)
class _Hashed:
    snapshot: Snapshot
    ends: list[int]
    hashes: list[bytes]
    view: memoryview | Sliced

    def chunk(self, index: int) -> tuple[int, int]:
        return chunk_span(self.ends, index)


@dataclass(eq=False)
class _Ticket:
    caller: ID
    token: bytes
    hashed: _Hashed
    last_used: float
    connections: int = 0
    bytes_served: int = 0
    scopes: set[trio.CancelScope] = field(default_factory=set)

    def revoke(self) -> None:
        for scope in self.scopes:
            scope.cancel()


#: The state to serve now (a coroutine: a trainer serializes it in its worker thread).
SnapshotSource = Callable[[], Awaitable[Snapshot | None]]


def held(snapshot: Snapshot | None) -> SnapshotSource:
    """A source that always serves `snapshot`."""

    async def source() -> Snapshot | None:
        return snapshot

    return source


class StateDonor:
    """Serves this peer's `snapshot()` to downloaders: manifests over RPC, chunks over TCP.

    `snapshot()` returns the state to give (None: nothing yet; `held(snapshot)` makes one of a
    fixed state); it should return the same object until the state changes, since chunk hashes are cached per snapshot. At most
    `max_downloads` tickets are live at once (one per caller; a ticket expires after
    `ticket_idle` seconds without a connection or request). One caller gets at most
    `caller_states` manifests per `caller_window` seconds (a token bucket), and a ticket serves
    at most TICKET_STATES times the state's bytes: a peer that downloads again and again, or
    asks for the same chunks over and over, degrades only its own service. A data connection
    holds an admission slot (`peer.net.admission`) until it has proved the network key, finished
    TLS and shown a live ticket. `wrap_stream` wraps each data connection's plaintext stream
    (tests inject faults there: a donor that lies, stalls or dies).

    A downloader with no direct path to us (we are behind NAT) fetches the chunks over a libp2p
    stream (`STATE_PROTOCOL`) instead, with the same framing: a stream from a peer that holds
    no live ticket is reset before a byte of it is read, and the ticket it shows must be its
    own (the stream's peer id is Noise-authenticated, so a ticket is no bearer token there).
    `advertised_port` is the port our manifests give (a port mapping's), if not the bound one.
    """

    def __init__(
        self,
        node: Node,
        snapshot: SnapshotSource,
        *,
        identity: DataIdentity | None = None,
        admission_limits: AdmissionLimits | None = None,
        max_downloads: int = 4,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        advertised_host: str | None = None,
        advertised_port: int | None = None,
        stream_limits: StreamLimits | None = None,
        ticket_idle: float = 10.0,
        stall_timeout: float = 10.0,
        caller_states: float = 20.0,
        caller_window: float = 300.0,
        wrap_stream: Callable[[trio.abc.Stream], trio.abc.Stream] | None = None,
    ) -> None:
        self.node = node
        self.snapshot = snapshot
        self.max_downloads = max_downloads
        self.chunk_bytes = chunk_bytes
        self.advertised_host = advertised_host
        self.advertised_port = advertised_port
        self.stream_gate = StreamGate(stream_limits)
        self.ticket_idle = ticket_idle
        self.stall_timeout = stall_timeout
        self.wrap_stream = wrap_stream
        # The data plane's TLS certificate; a daemon shares one with its all-reduce server.
        self.identity = identity or DataIdentity(
            node.identity.key_pair.private_key, node.peer_id.to_base58()
        )
        self.admission = Admission(node.network_key_bytes, admission_limits)
        # Manifests per caller, in thousandths so that caller_states may be fractional.
        self.budgets = ByteBudgets(capacity=round(caller_states * 1000), window=caller_window)
        self.max_message_bytes = node.rpc.max_message_bytes
        self.max_chunks = min(MAX_CHUNKS, self._manifest_room(0) // CHUNK_MANIFEST_BYTES)
        self._data: tuple[str, int] | None = None
        self._hashed: _Hashed | None = None
        self._hash_lock = trio.Lock()
        self._tickets: dict[bytes, _Ticket] = {}
        self._by_caller: dict[ID, bytes] = {}
        self._chunks_served = 0
        self._bytes_served = 0
        self._refused = 0
        server = RpcServer(node.host, SERVICE, max_message_bytes=node.rpc.max_message_bytes)
        server.add_unary("manifest", ManifestRequest, self._on_manifest)
        server.add_unary("release", Release, self._on_release)
        node.host.set_stream_handler(STATE_PROTOCOL, self._handle_stream)

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen for data connections on (host, port); reports the bound port to `start`."""
        try:
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(
                    functools.partial(self.admission.serve, host=host), self._handle, port
                )
                bound = listeners[0].socket.getsockname()[1]
                self._data = (
                    self.advertised_host or self._default_host(host),
                    self.advertised_port or bound,
                )
                task_status.started(bound)
        finally:
            self._data = None
            for ticket in self._tickets.values():
                ticket.revoke()
            self._tickets.clear()
            self._by_caller.clear()

    def _default_host(self, bound: str) -> str:
        if bound not in ("", "0.0.0.0", "::"):
            return bound
        for addr in self.node.announce:
            host = host_of(str(addr))
            if host is not None:  # else a /dns address: not an IP to hand out
                return host
        return "127.0.0.1"

    async def hash_snapshot(self) -> Snapshot | None:
        """Hash the current snapshot now (else the first manifest request does)."""
        snapshot = await self.snapshot()
        if snapshot is not None:
            await self._hash(snapshot)
        return snapshot

    def statistics(self) -> DonorStatistics:
        return DonorStatistics(
            step=self._hashed.snapshot.step if self._hashed else None,
            downloads=self._live_tickets(),
            connections=sum(t.connections for t in self._tickets.values()),
            chunks_served=self._chunks_served,
            bytes_served=self._bytes_served,
            refused=self._refused,
        )

    # ------------------------------------------------------------ control (RPC)

    async def _on_manifest(self, caller: ID, request: ManifestRequest) -> Manifest:
        snapshot = await self.snapshot()
        if snapshot is None or snapshot.step < request.min_step:
            held = "nothing" if snapshot is None else f"step {snapshot.step}"
            raise RpcError(
                "unavailable", f"nothing at step >= {request.min_step} here (holding {held})"
            )
        self._check_budget(caller)
        self._check_capacity(caller)
        hashed = await self._hash(snapshot)
        self._check_capacity(caller)  # others may have taken tickets while we hashed
        if self._data is None:
            raise RpcError("unavailable", "the state donor is not serving (stopping or starting)")
        old = self._by_caller.pop(caller, None)
        if old is not None:
            self._tickets.pop(old).revoke()
        token = secrets.token_bytes(TICKET_BYTES)
        self._tickets[token] = _Ticket(caller, token, hashed, trio.current_time())
        self._by_caller[caller] = token
        host, port = self._data
        return Manifest(
            step=snapshot.step,
            total_bytes=len(hashed.view),
            ends=hashed.ends,
            hashes=hashed.hashes,
            data_host=host,
            data_port=port,
            data_cert=self.identity.certificate,
            ticket=token,
            members=fitting(snapshot.members, room=self._manifest_room(len(hashed.ends))),
        )

    def _manifest_room(self, chunks: int) -> int:
        """Bytes of one RPC message a manifest of `chunks` chunks leaves for its members."""
        return self.max_message_bytes - MANIFEST_SLACK - chunks * CHUNK_MANIFEST_BYTES

    def _check_capacity(self, caller: ID) -> None:
        serving = self._live_tickets() - (caller in self._by_caller)
        if serving >= self.max_downloads:
            self._refused += 1
            raise RpcError(
                "unavailable",
                f"busy: serving {serving} downloads (limit {self.max_downloads}); ask another donor",
            )

    def _check_budget(self, caller: ID) -> None:
        """Refuse a manifest to a caller that has spent its download budget."""
        wait = self.budgets.try_spend(caller, 1000, now=trio.current_time())
        if wait > 0:
            self._refused += 1
            raise RpcError(
                "unavailable",
                f"download budget spent (you took the state here recently); retry in {wait:.0f} s "
                "or ask another donor",
            )

    async def _on_release(self, caller: ID, request: Release) -> Released:
        ticket = self._tickets.get(request.ticket)
        if ticket is not None and ticket.caller == caller:
            self._forget(ticket)
            ticket.revoke()
        return Released()

    def _forget(self, ticket: _Ticket) -> None:
        self._tickets.pop(ticket.token, None)
        if self._by_caller.get(ticket.caller) == ticket.token:
            del self._by_caller[ticket.caller]

    def _live_tickets(self) -> int:
        now = trio.current_time()
        for ticket in list(self._tickets.values()):
            if not ticket.connections and now - ticket.last_used > self.ticket_idle:
                self._forget(ticket)
        return len(self._tickets)

    async def _hash(self, snapshot: Snapshot) -> _Hashed:
        async with self._hash_lock:
            cached = self._hashed
            if (
                cached is not None
                and cached.snapshot.blob is snapshot.blob
                and cached.snapshot.step == snapshot.step
            ):
                return cached
            total = len(snapshot.blob)
            size = donor_chunk_bytes(total, self.chunk_bytes, max_chunks=self.max_chunks)
            ends = chunk_ends(total, snapshot.parts, size)
            if len(ends) > self.max_chunks:  # many small parts: fixed chunks fit
                ends = fixed_ends(total, size)
            if len(ends) > self.max_chunks:
                raise RpcError("unavailable", f"a state of {total} bytes is too large")
            view = sliceable(snapshot.blob)
            started = time.perf_counter()
            # Shielded: a caller giving up must not waste the work (the threads would finish
            # anyway), or a state that takes longer to hash than an RPC deadline never would be.
            ranges = [chunk_span(ends, index) for index in range(len(ends))]
            with trio.CancelScope(shield=True):
                hashes = await _hash_chunks(view, ranges, snapshot.hashes)
            reused = sum(span in snapshot.hashes for span in ranges)
            log.debug(
                "hashed the state of step %d (%d bytes, %d of %d chunk hashes known) in %.3f s",
                snapshot.step,
                total,
                reused,
                len(ends),
                time.perf_counter() - started,
            )
            self._hashed = _Hashed(snapshot, ends, hashes, view)
            return self._hashed

    # ------------------------------------------------------------ data (TCP)

    async def _handle(self, raw: trio.SocketStream) -> None:
        # One connection's failure is that connection's: nothing may reach serve_tcp.
        try:
            await self._serve_raw(raw)
        except CONNECTION_ERRORS as error:
            log.debug("state data connection ended: %r", error)

    async def _serve_raw(self, raw: trio.SocketStream) -> None:
        admitted = await self.admission.accept(raw, self.identity.open_server, self._greet)
        if admitted is None:
            return
        tls, (stream, reader, hello) = admitted
        async with tls:
            try:
                await self._serve_connection(stream, reader, hello)
            except CONNECTION_ERRORS as error:
                log.debug("state data connection ended: %r", error)

    async def _greet(self, tls: DataStream) -> tuple[trio.abc.Stream, _Reader, bytes] | None:
        """The connection's greeting (MAGIC | ticket), read through `wrap_stream`."""
        stream = self.wrap_stream(tls) if self.wrap_stream else tls
        reader = _Reader(stream)
        hello = await reader.exactly(len(MAGIC) + TICKET_BYTES)
        if hello is None or not hello.startswith(MAGIC):
            return None
        return stream, reader, hello

    # ------------------------------------------------------------ data (libp2p stream)

    async def _handle_stream(self, raw: INetStream) -> None:
        # Runs in the libp2p connection's task: nothing may escape it.
        stream = Libp2pStream(raw)
        try:
            await self._serve_stream(stream)
        except CONNECTION_ERRORS as error:
            log.debug("state data stream from %s ended: %r", stream.remote_peer_id, error)
        finally:
            await stream.aclose()

    async def _serve_stream(self, stream: Libp2pStream) -> None:
        caller = stream.remote_peer_id
        token = self._by_caller.get(caller)
        if stream.relayed or token is None or self._data is None:
            await stream.reset()  # no ticket of this peer: costs a reset, nothing more
            return
        greeted = None
        with self.stream_gate.slot(caller) as scope:
            if scope is not None:
                with scope:
                    greeted = await self._greet(stream)
        if greeted is None:
            await stream.reset()
            return
        wrapped, reader, hello = greeted
        if hello[len(MAGIC) :] != token:  # another peer's ticket, or an old one of ours
            await self._send_error(wrapped, "not your ticket; ask for a manifest again")
            return
        await self._serve_connection(wrapped, reader, hello)

    async def _serve_connection(
        self, stream: trio.abc.Stream, reader: _Reader, hello: bytes
    ) -> None:
        ticket = self._tickets.get(bytes(hello[len(MAGIC) :]))
        if ticket is None or (
            not ticket.connections and trio.current_time() - ticket.last_used > self.ticket_idle
        ):
            await self._send_error(stream, "unknown or expired ticket; ask for a manifest again")
            return
        if ticket.connections >= MAX_CONNECTIONS_PER_TICKET:
            await self._send_error(
                stream, f"at most {MAX_CONNECTIONS_PER_TICKET} connections per ticket"
            )
            return
        ticket.connections += 1
        scope = trio.CancelScope()
        ticket.scopes.add(scope)
        try:
            with scope:
                await self._serve_requests(stream, reader, ticket)
        finally:
            ticket.connections -= 1
            ticket.scopes.discard(scope)
            ticket.last_used = trio.current_time()

    async def _serve_requests(
        self, stream: trio.abc.Stream, reader: _Reader, ticket: _Ticket
    ) -> None:
        hashed = ticket.hashed
        count = len(hashed.hashes)
        while True:
            request = None
            with trio.move_on_after(self.stall_timeout):
                request = await reader.exactly(REQUEST.size)
            if request is None:
                return  # the downloader is done (EOF) or went quiet
            (index,) = REQUEST.unpack(request)
            if index >= count:
                await self._send_error(stream, f"chunk {index} does not exist (0 to {count - 1})")
                return
            ticket.last_used = trio.current_time()
            start, end = hashed.chunk(index)
            if ticket.bytes_served + (end - start) > TICKET_STATES * len(hashed.view):
                self._refused += 1
                await self._send_error(stream, "this ticket is used up; ask for a manifest again")
                return
            ticket.bytes_served += end - start
            with trio.fail_after(self.stall_timeout):
                await stream.send_all(REPLY.pack(KIND_CHUNK, index, end - start))
            for offset in range(start, end, SEND_SLICE):
                # Slices: the state is never copied whole on its way to the socket (a trainer's
                # is read from its tensors, `state.StateBytes`; stale after its next step).
                with trio.fail_after(self.stall_timeout):
                    await stream.send_all(hashed.view[offset : min(offset + SEND_SLICE, end)])
            self._chunks_served += 1
            self._bytes_served += end - start

    async def _send_error(self, stream: trio.abc.Stream, message: str) -> None:
        data = message.encode()[:MAX_ERROR_BYTES]
        with trio.move_on_after(1.0):
            await stream.send_all(REPLY.pack(KIND_ERROR, 0, len(data)) + data)


class _Reader:
    """Exact reads of small messages from a stream (requests are a few bytes each)."""

    def __init__(self, stream: trio.abc.Stream | DataStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def exactly(self, size: int) -> bytes | None:
        """`size` bytes, or None at a clean end of stream before the first of them."""
        while len(self.buffer) < size:
            data = await self.stream.receive_some(4096)
            if not data:
                if self.buffer:
                    raise ProtocolError(f"stream ended {len(self.buffer)} bytes into a message")
                return None
            self.buffer += data
        out = bytes(self.buffer[:size])
        del self.buffer[:size]
        return out


__all__ = ["DonorStatistics", "StateDonor"]
