"""State download: a late or lagging peer fetches the training state from up-to-date peers.

Control over libp2p, bulk bytes over plain TCP. A py-libp2p Noise + yamux stream tops out near
0.3 GB/s and keeps a core busy (docs/benchmarks.md), a tenth of loopback TCP, so:

    /peertrain/state/1 (RPC)  manifest{min_step} -> Manifest{step, total_bytes, chunk_bytes,
                                                   hashes, data_host, data_port, ticket}
                                                | Err{unavailable}   nothing new enough / busy
                              release{ticket}   -> Released{}        the download is over
    data port (TCP)           client: MAGIC | ticket, then chunk indices (4 bytes each, pipelined)
                              donor:  per index, in order: kind | index | length, then `length`
                                      bytes (the chunk, or a UTF-8 error that ends the connection)

Integrity comes from the manifest, which travels over the Noise-authenticated RPC: every chunk
is checked against its SHA-256 before it is accepted, so the TCP bytes need no authentication
of their own. The ticket (32 random bytes) is only an admission token that bounds how many
downloads a donor serves at once (`max_downloads`); it travels in clear, which gives an
eavesdropper nothing that a fresh libp2p identity could not get by asking. The state itself
is not secret from any peer that joins the collaboration; the data plane does not encrypt it.

A donor pins, per ticket, the exact `Snapshot` its manifest describes, so a step that ends
mid-download does not change the bytes under the downloader. Chunk hashes are computed once
per snapshot, in worker threads (SHA-256 releases the GIL: ~0.5 s/GB per thread here). The
downloader receives straight into its result buffer and hashes each chunk in a worker thread
while the next one arrives. Protocol decisions (which manifest, who serves which chunk,
requeueing) are pure code in `peer.training.chunks`. Nothing received is unpickled.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import mmap
import os
import secrets
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from peer.errors import DeadlineExceeded, ProtocolError, RemoteError, RpcError
from peer.net.host import Node
from peer.net.rpc import RpcServer
from peer.training.chunks import (
    HASH_BYTES,
    MAX_CHUNKS,
    SERVICE,
    TICKET_BYTES,
    BadManifest,
    DownloadPlan,
    Manifest,
    ManifestRequest,
    Release,
    Released,
    check_manifest,
    choose_manifest,
    chunk_count,
    chunk_range,
    donor_chunk_bytes,
)

log = logging.getLogger("peertrain.statesync")

MAGIC = b"PTSTATE1"  # first bytes of a data connection: protocol and version
REQUEST = struct.Struct(">I")  # chunk index
REPLY = struct.Struct(">BIQ")  # kind, chunk index, length
KIND_CHUNK, KIND_ERROR = 0, 1
MAX_ERROR_BYTES = 1024
PIPELINE = 2  # chunk requests a downloader keeps outstanding per donor (hides one round trip)
SEND_SLICE = 1 << 20  # a stalled receiver is noticed within a slice
MAX_CONNECTIONS_PER_TICKET = 2
HASH_WORKERS = max(1, min(4, os.cpu_count() or 1))
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_MAX_TOTAL_BYTES = 64 << 30
IN_PLACE_MIN_BYTES = 1 << 20  # below this, one copy at the end is cheaper than the trick
EXTRA_ASKED = 2  # donors asked for a manifest beyond `parallel`, as reserves
# Errors of a data connection that end it (and drop its donor).
CONNECTION_ERRORS = (
    RemoteError,
    OSError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    trio.TooSlowError,
)


@dataclass(frozen=True)
class Snapshot:
    """A training state at a step boundary, serialized (safetensors bytes; opaque here)."""

    step: int
    blob: bytes


class StateDownloadFailed(RemoteError):
    """No donor could finish the download; the message names each donor's failure."""


class _ResultBuffer:
    """The downloaded state's bytes, written chunk by chunk through `view`, then `take()`n.

    `Snapshot.blob` is `bytes`; receiving into a buffer and copying it out costs ~0.37 s/GB
    here, nearly all of it first-touch page faults on the copy. So, on CPython, the result is
    built in place the way C code builds bytes (`PyBytes_FromStringAndSize(NULL, n)`, then
    fill): the object is ours alone until the download completes, and no one reads it before.
    Its pages are marked for transparent huge pages (Linux `madvise`, best effort), which
    makes the faults ~4x cheaper (0.09 s/GB). Elsewhere: a bytearray and one copy at the end.
    """

    def __init__(self, size: int) -> None:
        self._blob: bytes | None = None
        if sys.implementation.name != "cpython" or size < IN_PLACE_MIN_BYTES:
            self.view = memoryview(bytearray(size))
            return
        new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)(
            ("PyBytes_FromStringAndSize", ctypes.pythonapi)
        )
        address_of = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(
            ("PyBytes_AsString", ctypes.pythonapi)
        )
        self._blob = new(None, size)
        address = address_of(self._blob)
        _advise_huge_pages(address, size)
        storage = (ctypes.c_char * size).from_address(address)
        storage._owner = self._blob  # type: ignore[attr-defined]  # views keep it alive
        self.view = memoryview(storage).cast("B")

    def take(self) -> bytes:
        """The bytes, once every chunk is written (the view must not be written again)."""
        return self._blob if self._blob is not None else bytes(self.view)


def _advise_huge_pages(address: int, size: int) -> None:
    if sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    huge = 2 << 20
    start = -(-address // huge) * huge
    length = (address + size - start) // huge * huge
    if length <= 0:
        return
    try:
        madvise = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(
            ("madvise", ctypes.CDLL(None))
        )
        madvise(start, length, mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass  # no libc madvise here: ordinary pages


def _sha256(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


async def _hash_chunks(view: memoryview, chunk_bytes: int) -> list[bytes]:
    """SHA-256 of every chunk, in HASH_WORKERS threads (hashlib releases the GIL)."""
    count = chunk_count(len(view), chunk_bytes)
    out = [b""] * count
    workers = min(HASH_WORKERS, count)

    def work(first: int) -> None:
        for index in range(first, count, workers):
            start, end = chunk_range(index, len(view), chunk_bytes)
            out[index] = _sha256(view[start:end])

    async with trio.open_nursery() as nursery:
        for first in range(workers):
            nursery.start_soon(functools.partial(trio.to_thread.run_sync, work, first))
    return out


# ---------------------------------------------------------------------------- donor


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
    chunk_bytes: int
    hashes: list[bytes]
    view: memoryview


@dataclass(eq=False)
class _Ticket:
    caller: ID
    token: bytes
    hashed: _Hashed
    last_used: float
    connections: int = 0
    scopes: set[trio.CancelScope] = field(default_factory=set)

    def revoke(self) -> None:
        for scope in self.scopes:
            scope.cancel()


class StateDonor:
    """Serves this peer's `snapshot()` to downloaders: manifests over RPC, chunks over TCP.

    `snapshot()` returns the state to give (None: nothing yet); it should return the same
    object until the state changes, since chunk hashes are cached per snapshot. At most
    `max_downloads` tickets are live at once (one per caller; a ticket expires after
    `ticket_idle` seconds without a connection or request). `wrap_stream` wraps each accepted
    data connection (tests inject faults there).
    """

    def __init__(
        self,
        node: Node,
        snapshot: Callable[[], Snapshot | None],
        *,
        max_downloads: int = 4,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        advertised_host: str | None = None,
        ticket_idle: float = 10.0,
        stall_timeout: float = 10.0,
        wrap_stream: Callable[[trio.SocketStream], trio.abc.Stream] | None = None,
    ) -> None:
        self.node = node
        self.snapshot = snapshot
        self.max_downloads = max_downloads
        self.chunk_bytes = chunk_bytes
        self.advertised_host = advertised_host
        self.ticket_idle = ticket_idle
        self.stall_timeout = stall_timeout
        self.wrap_stream = wrap_stream
        # The manifest must fit one RPC message: 34 bytes per msgpack'd hash, plus slack.
        self.max_chunks = min(MAX_CHUNKS, (node.rpc.max_message_bytes - 1024) // (HASH_BYTES + 2))
        self._data: tuple[str, int] | None = None
        self._hashed: _Hashed | None = None
        self._hash_lock = trio.Lock()
        self._tickets: dict[bytes, _Ticket] = {}
        self._by_caller: dict[ID, bytes] = {}
        self._connections = 0
        self._chunks_served = 0
        self._bytes_served = 0
        self._refused = 0
        server = RpcServer(node.host, SERVICE, max_message_bytes=node.rpc.max_message_bytes)
        server.add_unary("manifest", ManifestRequest, self._on_manifest)
        server.add_unary("release", Release, self._on_release)

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen for data connections on (host, port); reports the bound port to `start`."""
        try:
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(
                    functools.partial(trio.serve_tcp, host=host), self._handle, port
                )
                bound = listeners[0].socket.getsockname()[1]
                self._data = (self.advertised_host or self._default_host(host), bound)
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
            try:
                return Multiaddr(str(addr)).value_for_protocol("ip4") or "127.0.0.1"
            except Exception:  # not an ip4 address
                continue
        return "127.0.0.1"

    async def hash_snapshot(self) -> Snapshot | None:
        """Hash the current snapshot now (else the first manifest request does)."""
        snapshot = self.snapshot()
        if snapshot is not None:
            await self._hash(snapshot)
        return snapshot

    def statistics(self) -> DonorStatistics:
        return DonorStatistics(
            step=self._hashed.snapshot.step if self._hashed else None,
            downloads=self._live_tickets(),
            connections=self._connections,
            chunks_served=self._chunks_served,
            bytes_served=self._bytes_served,
            refused=self._refused,
        )

    # ------------------------------------------------------------ control (RPC)

    async def _on_manifest(self, caller: ID, request: ManifestRequest) -> Manifest:
        snapshot = self.snapshot()
        if snapshot is None or snapshot.step < request.min_step:
            held = "nothing" if snapshot is None else f"step {snapshot.step}"
            raise RpcError(
                "unavailable", f"nothing at step >= {request.min_step} here (holding {held})"
            )
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
            chunk_bytes=hashed.chunk_bytes,
            hashes=hashed.hashes,
            data_host=host,
            data_port=port,
            ticket=token,
        )

    def _check_capacity(self, caller: ID) -> None:
        serving = self._live_tickets() - (caller in self._by_caller)
        if serving >= self.max_downloads:
            self._refused += 1
            raise RpcError(
                "unavailable",
                f"busy: serving {serving} downloads (limit {self.max_downloads}); ask another donor",
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
            size = donor_chunk_bytes(
                len(snapshot.blob), self.chunk_bytes, max_chunks=self.max_chunks
            )
            if chunk_count(len(snapshot.blob), size) > self.max_chunks:
                raise RpcError("unavailable", f"a state of {len(snapshot.blob)} bytes is too large")
            view = memoryview(snapshot.blob).cast("B")
            started = time.perf_counter()
            # Shielded: a caller giving up must not waste the work (the threads would finish
            # anyway), or a state that takes longer to hash than an RPC deadline never would be.
            with trio.CancelScope(shield=True):
                hashes = await _hash_chunks(view, size)
            log.debug(
                "hashed the state of step %d (%d bytes) in %.3f s",
                snapshot.step,
                len(view),
                time.perf_counter() - started,
            )
            self._hashed = _Hashed(snapshot, size, hashes, view)
            return self._hashed

    # ------------------------------------------------------------ data (TCP)

    async def _handle(self, raw: trio.SocketStream) -> None:
        # Unauthenticated connections cost a task and a socket each: bounded, and each gets
        # `stall_timeout` to present its ticket.
        if self._connections >= MAX_CONNECTIONS_PER_TICKET * self.max_downloads + 16:
            return
        self._connections += 1
        try:
            stream = self.wrap_stream(raw) if self.wrap_stream else raw
            await self._serve_connection(stream)
        except CONNECTION_ERRORS as error:
            log.debug("state data connection ended: %r", error)
        finally:
            self._connections -= 1

    async def _serve_connection(self, stream: trio.abc.Stream) -> None:
        reader = _Reader(stream)
        hello = None
        with trio.move_on_after(self.stall_timeout):
            hello = await reader.exactly(len(MAGIC) + TICKET_BYTES)
        if hello is None or not hello.startswith(MAGIC):
            return
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
            start, end = chunk_range(index, len(hashed.view), hashed.chunk_bytes)
            with trio.fail_after(self.stall_timeout):
                await stream.send_all(REPLY.pack(KIND_CHUNK, index, end - start))
            for offset in range(start, end, SEND_SLICE):
                # memoryview slices: the blob is never copied on its way to the socket.
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

    def __init__(self, stream: trio.abc.Stream) -> None:
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


# ---------------------------------------------------------------------------- downloader


@dataclass(frozen=True)
class DownloadStatistics:
    step: int | None
    """Step of the manifest being followed (None: none chosen yet)."""
    total_bytes: int
    chunks: int
    done: int
    chunks_from: dict[str, int]
    """Verified chunks per donor (peer id)."""
    rejected: dict[str, int]
    """Chunks per donor that failed their SHA-256 check."""
    dropped: dict[str, str]
    """Donors dropped mid-download, and why."""
    refused: dict[str, str]
    """Donors whose offer was not used (refused, unreachable, stale, malformed), and why."""


class StateDownload:
    """One download of the state at `min_step` or later from `donors` (best first).

    Asks `parallel + 2` donors for a manifest at a time, follows one manifest
    (`chunks.choose_manifest`), fetches from up to `parallel` donors at once, each chunk
    checked against its SHA-256, and replaces donors that fail. `stall_timeout` bounds every
    wait for a donor's bytes, `rpc_timeout` every control call; `run(deadline=)` the whole.
    """

    def __init__(
        self,
        node: Node,
        donors: Sequence[ID],
        *,
        min_step: int,
        parallel: int = 3,
        rpc_timeout: float = 5.0,
        stall_timeout: float = 10.0,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    ) -> None:
        if parallel < 1:
            raise ValueError(f"parallel={parallel!r}, expected at least 1")
        self.node = node
        self.min_step = min_step
        self.parallel = parallel
        self.rpc_timeout = rpc_timeout
        self.stall_timeout = stall_timeout
        self.max_total_bytes = max_total_bytes
        self._order = [d for d in dict.fromkeys(donors) if d != node.peer_id]
        self._unasked = deque(self._order)
        self._asking = False
        self._offers: dict[ID, Manifest] = {}
        self._tickets: dict[ID, bytes] = {}
        self._refused: dict[ID, str] = {}
        self._plan: DownloadPlan[ID] | None = None
        self._pulls: dict[ID, trio.CancelScope] = {}
        self._changed = trio.Event()
        self._hashers = trio.CapacityLimiter(HASH_WORKERS)
        self._view = memoryview(b"")

    async def run(self, *, deadline: float) -> Snapshot:
        """The state, bit for bit the chosen donor's; StateDownloadFailed if no donor can finish
        it by `deadline` (trio time)."""
        started = trio.current_time()
        try:
            with trio.fail_at(deadline):
                snapshot = await self._run()
        except trio.TooSlowError:
            raise StateDownloadFailed(self._failure("not finished by the deadline")) from None
        finally:
            await self._release_tickets()
        stats = self.statistics()
        log.info(
            "downloaded the state of step %d (%d bytes) in %.2f s from %d donors",
            snapshot.step,
            len(snapshot.blob),
            trio.current_time() - started,
            len(stats.chunks_from),
        )
        return snapshot

    def statistics(self) -> DownloadStatistics:
        plan = self._plan
        stats = plan.statistics() if plan else None
        return DownloadStatistics(
            step=plan.manifest.step if plan else None,
            total_bytes=plan.manifest.total_bytes if plan else 0,
            chunks=stats.chunks if stats else 0,
            done=stats.done if stats else 0,
            chunks_from={str(d): n for d, n in stats.chunks_from.items()} if stats else {},
            rejected={str(d): n for d, n in stats.rejected.items()} if stats else {},
            dropped={str(d): r for d, r in stats.dropped.items()} if stats else {},
            refused={str(d): r for d, r in self._refused.items()},
        )

    async def _run(self) -> Snapshot:
        # 1. Offers: ask batches of donors until one manifest can be followed.
        while self._plan is None:
            if not self._unasked:
                raise StateDownloadFailed(self._failure("no donor offered it"))
            await self._ask_batch(self._next_batch())
            # In the caller's order of preference, not the order the answers came in.
            owner = choose_manifest({d: self._offers[d] for d in self._order if d in self._offers})
            if owner is not None:
                self._follow(owner)
        plan = self._plan
        # The result itself: chunks are received straight into it, never copied.
        try:
            result = _ResultBuffer(plan.manifest.total_bytes)
        except MemoryError:
            raise StateDownloadFailed(
                self._failure(f"no memory for a state of {plan.manifest.total_bytes} bytes")
            ) from None
        self._view = result.view
        # 2. Chunks: start donors, ask more when short of them, until done or stuck.
        failure = None
        async with trio.open_nursery() as nursery:
            while not plan.complete:
                for donor in plan.donors_to_start():
                    nursery.start_soon(self._fetch_from, nursery, donor)
                stuck = plan.unservable()
                short = plan.live_donors() < self.parallel
                if (stuck or short) and self._unasked and not self._asking:
                    nursery.start_soon(self._ask_batch, self._next_batch())
                elif stuck and not self._asking:
                    failure = f"chunks {_ranges(stuck)} have no donor left"
                    break
                await self._changed.wait()
                self._changed = trio.Event()
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise StateDownloadFailed(self._failure(failure))
        self._view = memoryview(b"")
        return Snapshot(plan.manifest.step, result.take())

    def _follow(self, owner: ID) -> None:
        self._plan = plan = DownloadPlan(owner, self._offers[owner], parallel=self.parallel)
        for donor in self._order:
            if donor != owner and donor in self._offers:
                self._offer(plan, donor, self._offers[donor])

    def _offer(self, plan: DownloadPlan[ID], donor: ID, manifest: Manifest) -> None:
        reason = plan.add_donor(donor, manifest)
        if reason is not None:
            self._refused[donor] = reason

    def _wake(self) -> None:
        self._changed.set()

    # ------------------------------------------------------------ manifests

    def _next_batch(self) -> list[ID]:
        """The next donors to ask, taken now, so the supervisor never starts two batches."""
        self._asking = True
        count = min(len(self._unasked), self.parallel + EXTRA_ASKED)
        return [self._unasked.popleft() for _ in range(count)]

    async def _ask_batch(self, batch: list[ID]) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for donor in batch:
                    nursery.start_soon(self._ask, donor)
        finally:
            self._asking = False
            self._wake()

    async def _ask(self, donor: ID) -> None:
        try:
            manifest = await self.node.rpc.call(
                donor,
                SERVICE,
                "manifest",
                ManifestRequest(self.min_step),
                Manifest,
                timeout=self.rpc_timeout,
            )
        except RemoteError as error:
            self._refused[donor] = str(error)
            return
        self._tickets[donor] = manifest.ticket
        try:
            check_manifest(manifest, min_step=self.min_step, max_total_bytes=self.max_total_bytes)
        except BadManifest as error:
            self._refused[donor] = str(error)
            return
        self._offers[donor] = manifest
        if self._plan is not None:
            self._offer(self._plan, donor, manifest)
        self._wake()

    async def _release_tickets(self) -> None:
        """Tell every donor that gave us a ticket that we are done (best effort, 1 s)."""

        async def release(donor: ID, ticket: bytes) -> None:
            with suppress(RemoteError):  # else its ticket expires on its own
                await self.node.rpc.call(
                    donor, SERVICE, "release", Release(ticket), Released, timeout=1.0
                )

        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            async with trio.open_nursery() as nursery:
                for donor, ticket in self._tickets.items():
                    nursery.start_soon(release, donor, ticket)
        self._tickets.clear()

    # ------------------------------------------------------------ chunks

    async def _fetch_from(self, nursery: trio.Nursery, donor: ID) -> None:
        """Pull chunks from `donor` until it has none left to give us, or fails."""
        plan = self._plan
        assert plan is not None
        offer = self._offers[donor]
        reason: str | None = None
        pull = self._pulls[donor] = trio.CancelScope()
        with pull:
            try:
                with trio.fail_after(self.stall_timeout):
                    stream = await trio.open_tcp_stream(offer.data_host, offer.data_port)
                async with stream:
                    await self._pull(nursery, donor, offer, stream)
            except CONNECTION_ERRORS as error:
                reason = _reason(error, self.stall_timeout)
        # Only now, with this task no longer writing, may its claimed chunks go to others.
        plan.stopped(donor, reason)
        if reason is not None:
            log.debug("state donor %s dropped: %s", donor, reason)
        self._wake()

    async def _pull(
        self, nursery: trio.Nursery, donor: ID, offer: Manifest, stream: trio.SocketStream
    ) -> None:
        plan = self._plan
        assert plan is not None
        header = bytearray(REPLY.size)
        requested: deque[int] = deque()
        await stream.send_all(MAGIC + offer.ticket)
        while True:
            new = []
            while len(requested) < PIPELINE and (index := plan.claim(donor)) is not None:
                requested.append(index)
                new.append(REQUEST.pack(index))
            if new:
                with trio.fail_after(self.stall_timeout):
                    await stream.send_all(b"".join(new))
            if not requested:
                return
            index = requested.popleft()
            start, end = chunk_range(index, plan.manifest.total_bytes, plan.manifest.chunk_bytes)
            await self._receive_into(stream, memoryview(header))
            kind, got, length = REPLY.unpack(header)
            if kind == KIND_ERROR:
                message = bytearray(min(length, MAX_ERROR_BYTES))
                await self._receive_into(stream, memoryview(message))
                raise RemoteError(f"it refused: {message.decode(errors='replace')}")
            if kind != KIND_CHUNK or got != index or length != end - start:
                raise ProtocolError(
                    f"reply (kind {kind}, chunk {got}, {length} bytes) to a request for chunk "
                    f"{index} of {end - start} bytes"
                )
            # Straight into the result buffer: no copy on the way in.
            await self._receive_into(stream, self._view[start:end])
            plan.received(donor, index)
            nursery.start_soon(self._check, donor, index)

    async def _receive_into(self, stream: trio.SocketStream, view: memoryview) -> None:
        """Fill `view`; DeadlineExceeded after `stall_timeout` without a byte."""
        got = 0
        with trio.CancelScope() as scope:
            while got < len(view):
                scope.deadline = trio.current_time() + self.stall_timeout
                count = await stream.socket.recv_into(view[got:])
                if not count:
                    raise ProtocolError(
                        f"connection closed {got} bytes into a {len(view)}-byte read"
                    )
                got += count
        if scope.cancelled_caught:
            raise DeadlineExceeded(f"no bytes for {self.stall_timeout:.3g} s")

    async def _check(self, donor: ID, index: int) -> None:
        plan = self._plan
        assert plan is not None
        start, end = chunk_range(index, plan.manifest.total_bytes, plan.manifest.chunk_bytes)
        # A worker thread, so hashing overlaps receiving the next chunk.
        digest = await trio.to_thread.run_sync(
            _sha256, self._view[start:end], limiter=self._hashers
        )
        if digest == plan.manifest.hashes[index]:
            plan.verified(donor, index)
        else:
            plan.rejected(donor, index)
            self._pulls[donor].cancel()
            log.debug("chunk %d from %s failed its SHA-256 check", index, donor)
        self._wake()

    def _failure(self, what: str) -> str:
        stats = self.statistics()
        progress = f"{stats.done} of {stats.chunks} chunks" if self._plan else "no manifest"
        why = {**stats.refused, **stats.dropped}
        donors = "; ".join(f"{d}: {r}" for d, r in list(why.items())[:6]) or "none asked"
        return (
            f"state download of step >= {self.min_step} failed: {what} ({progress}); "
            f"donors: {donors}; retry later or with other donors"
        )


async def download_state(
    node: Node,
    donors: Sequence[ID],
    *,
    min_step: int,
    deadline: float,
    parallel: int = 3,
    rpc_timeout: float = 5.0,
    stall_timeout: float = 10.0,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
) -> Snapshot:
    """Download the state at `min_step` or later from `donors` (best first) by `deadline`
    (trio time); see `StateDownload`. Raises StateDownloadFailed."""
    download = StateDownload(
        node,
        donors,
        min_step=min_step,
        parallel=parallel,
        rpc_timeout=rpc_timeout,
        stall_timeout=stall_timeout,
        max_total_bytes=max_total_bytes,
    )
    return await download.run(deadline=deadline)


def _reason(error: BaseException, stall_timeout: float) -> str:
    if isinstance(error, trio.TooSlowError):
        return f"no progress for {stall_timeout:.3g} s"
    return str(error) or repr(error)


def _ranges(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:8]))
    return shown + (f" and {len(indices) - 8} more" if len(indices) > 8 else "")


__all__ = [
    "DonorStatistics",
    "DownloadStatistics",
    "Snapshot",
    "StateDonor",
    "StateDownload",
    "StateDownloadFailed",
    "download_state",
]
