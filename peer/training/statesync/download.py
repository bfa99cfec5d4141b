"""State download, the downloader: `StateDownload` fetches a snapshot from several donors."""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import trio
from libp2p.peer.id import ID

from peer.errors import DeadlineExceeded, ProtocolError, RemoteError, first_error
from peer.net.admission import check_dial_address, connect
from peer.net.host import Node, host_of
from peer.net.streamio import (
    DIRECT_TIMEOUT,
    STATE_PROTOCOL,
    STREAM_PATH,
    TLS_PATH,
    DataStream,
    open_stream,
)
from peer.net.tls import certificate_peer_id, pinned_client_context
from peer.training.chunks import (
    SERVICE,
    BadManifest,
    DownloadPlan,
    Manifest,
    ManifestRequest,
    Release,
    Released,
    check_manifest,
    choose_manifest,
    chunk_hash,
)
from peer.training.statesync.inplace import EarlyChunks, Sink
from peer.training.statesync.wire import (
    CONNECTION_ERRORS,
    HASH_WORKERS,
    KIND_CHUNK,
    KIND_ERROR,
    MAGIC,
    MAX_ERROR_BYTES,
    REPLY,
    REQUEST,
    Snapshot,
)

log = logging.getLogger("peertrain.statesync")
T = TypeVar("T")

PIPELINE = 2  # chunk requests a downloader keeps outstanding per donor (hides one round trip)
DEFAULT_MAX_TOTAL_BYTES = 64 << 30
IN_PLACE_MIN_BYTES = 1 << 20  # below this, one copy at the end is cheaper than the trick
EXTRA_ASKED = 2  # donors asked for a manifest beyond `parallel`, as reserves
YIELD_BYTES = 256 << 10  # received between two chances for other tasks to run


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
    """Chunks per donor that failed their hash check."""
    dropped: dict[str, str]
    """Donors dropped mid-download, and why."""
    refused: dict[str, str]
    """Donors whose offer was not used (refused, unreachable, stale, malformed), and why."""
    paths: dict[str, str] = field(default_factory=dict)
    """How we reached each donor we fetched from: `TLS_PATH` (direct TCP) or `STREAM_PATH` (a
    libp2p stream: no direct path)."""


class StateDownload:
    """One download of the state at `min_step` or later from `donors` (best first).

    Asks `parallel + 2` donors for a manifest at a time, follows one manifest
    (`chunks.choose_manifest`), fetches from up to `parallel` donors at once, each chunk
    checked against its hash, and replaces donors that fail. `stall_timeout` bounds every
    wait for a donor's bytes, `rpc_timeout` every control call; `run(deadline=)` the whole.
    A donor's data address is dialled directly (TLS) if we may dial it; if we may not, or it
    connects nowhere within `direct_timeout`, its chunks come over a libp2p stream to it
    (`peer.net.streamio`), which Noise authenticates as the donor.
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
        direct_timeout: float = DIRECT_TIMEOUT,
    ) -> None:
        if parallel < 1:
            raise ValueError(f"parallel={parallel!r}, expected at least 1")
        self.node = node
        self.min_step = min_step
        self.parallel = parallel
        self.rpc_timeout = rpc_timeout
        self.stall_timeout = stall_timeout
        self.max_total_bytes = max_total_bytes
        self.direct_timeout = direct_timeout
        self._no_direct: set[ID] = set()  # donors we reach over libp2p only
        self._paths: dict[ID, str] = {}
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
        self._into: Callable[[int], memoryview] = _nowhere  # where a chunk is received
        self._network_key = node.network_key_bytes
        self._own_host = _own_host(node)

    async def run(self, *, deadline: float) -> Snapshot:
        """The state, bit for bit the chosen donor's; StateDownloadFailed if no donor can finish
        it by `deadline` (trio time)."""
        return await self._timed(self._run(), deadline)

    async def run_into(self, sink: Sink, *, deadline: float) -> int:
        """The state, bit for bit the chosen donor's, into `sink` (`statesync.inplace`), and its
        step; StateDownloadFailed if no donor can finish it by `deadline` (trio time), or if
        `sink` refuses it."""
        return await self._timed(self._run_into(sink), deadline)

    async def _timed(self, download: Awaitable[T], deadline: float) -> T:
        started = trio.current_time()
        try:
            with trio.fail_at(deadline):
                result = await download
        except trio.TooSlowError:
            raise StateDownloadFailed(self._failure("not finished by the deadline")) from None
        except BaseExceptionGroup as group:
            # Raised inside a nursery, a failure comes out wrapped: the trainer retries a
            # StateDownloadFailed, and anything else (a group) would end the daemon. A sink's
            # refusal (a RemoteError: a state no quorum certified) is the download's failure.
            remote, rest = group.split(RemoteError)
            if remote is None or rest is not None:
                raise
            error = first_error(remote)
            if isinstance(error, StateDownloadFailed):
                raise error from None
            raise StateDownloadFailed(self._failure(f"its state: {error}")) from None
        finally:
            await self._release_tickets()
        stats = self.statistics()
        log.info(
            "downloaded the state of step %d (%d bytes) in %.2f s from %d donors",
            stats.step,
            stats.total_bytes,
            trio.current_time() - started,
            len(stats.chunks_from),
        )
        return result

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
            paths={str(d): p for d, p in self._paths.items()},
        )

    async def _run(self) -> Snapshot:
        plan = await self._choose(held_back=False)
        # The result itself: chunks are received straight into it, never copied.
        try:
            result = _ResultBuffer(plan.manifest.total_bytes)
        except MemoryError:
            raise StateDownloadFailed(
                self._failure(f"no memory for a state of {plan.manifest.total_bytes} bytes")
            ) from None
        view = result.view
        self._into = lambda index: view[slice(*plan.manifest.chunk(index))]
        async with trio.open_nursery() as asks:
            await self._fetch_admitted(asks)
            asks.cancel_scope.cancel()
        self._into = _nowhere
        manifest = plan.manifest
        # Every chunk has passed its check: these are the hashes of the bytes we hold.
        checked = {manifest.chunk(i): digest for i, digest in enumerate(manifest.hashes)}
        return Snapshot(
            manifest.step,
            result.take(),
            hashes=checked,
            disposable=True,
            members=tuple(manifest.members),
        )

    async def _run_into(self, sink: Sink) -> int:
        plan = await self._choose(held_back=True)
        manifest = plan.manifest
        early = EarlyChunks(manifest)
        self._into = early.view
        # Asks for more donors outlive a round: one cut short lost the donors it had taken.
        async with trio.open_nursery() as asks:
            try:
                # The header, then what the state's check needs, each in a round of its own.
                while wanted := [i for i in await sink.first(manifest, early) if i not in early]:
                    plan.admit(wanted)
                    await self._fetch_admitted(asks)
                where = await sink.admit(manifest, early)
            except ProtocolError as error:  # the followed donor's bytes (each checked) say so
                raise StateDownloadFailed(self._failure(f"its state: {error}")) from None
            places = {index: where(index) for index in plan.held_back()}
            targets = {index: view for index, view in places.items() if view is not None}
            plan.skip(places.keys() - targets.keys())
            self._into = targets.__getitem__
            plan.admit(targets)
            await self._fetch_admitted(asks)
            asks.cancel_scope.cancel()
        self._into = _nowhere
        return manifest.step

    async def _choose(self, *, held_back: bool) -> DownloadPlan[ID]:
        """Ask batches of donors for offers until one manifest can be followed."""
        while self._plan is None:
            if not self._unasked:
                raise StateDownloadFailed(self._failure("no donor offered it"))
            await self._ask_batch(self._next_batch())
            # In the caller's order of preference, not the order the answers came in.
            owner = choose_manifest({d: self._offers[d] for d in self._order if d in self._offers})
            if owner is not None:
                self._follow(owner, held_back=held_back)
        return self._plan

    async def _fetch_admitted(self, asks: trio.Nursery) -> None:
        """Start donors, ask more when short of them (in `asks`), until every chunk admitted
        is done or some have no donor left (StateDownloadFailed)."""
        plan = self._plan
        assert plan is not None
        failure = None
        async with trio.open_nursery() as nursery:
            while not plan.settled:
                for donor in plan.donors_to_start():
                    nursery.start_soon(self._fetch_from, nursery, donor)
                stuck = plan.unservable()
                short = plan.live_donors() < self.parallel
                if (stuck or short) and self._unasked and not self._asking:
                    asks.start_soon(self._ask_batch, self._next_batch())
                elif stuck and not self._asking:
                    failure = f"chunks {_ranges(stuck)} have no donor left"
                    break
                await self._changed.wait()
                self._changed = trio.Event()
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise StateDownloadFailed(self._failure(failure))

    def _follow(self, owner: ID, *, held_back: bool) -> None:
        self._plan = plan = DownloadPlan(
            owner, self._offers[owner], parallel=self.parallel, held_back=held_back
        )
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
            if certificate_peer_id(manifest.data_cert) != donor.to_base58():
                raise BadManifest("its data certificate names another peer")
        except ProtocolError as error:
            self._refused[donor] = str(error)
            return
        try:
            check_dial_address(manifest.data_host, manifest.data_port, own_host=self._own_host)
        except ProtocolError as error:  # never dialled: its chunks come over libp2p
            log.debug("state donor %s: %s; fetching over libp2p", donor, error)
            self._no_direct.add(donor)
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
        try:
            with pull:
                try:
                    # Connecting, the key and the handshake: a stall timeout each, at most.
                    with trio.fail_after(2 * self.stall_timeout):
                        stream = await self._open(donor, offer)
                    async with stream:
                        await self._pull(nursery, donor, offer, stream)
                except CONNECTION_ERRORS as error:
                    reason = _reason(error, self.stall_timeout)
        finally:
            # Only now, with this task no longer writing, may its claimed chunks go to others;
            # also when a round ends with it still connecting (it is idle, for the next round).
            plan.stopped(donor, reason)
        if reason is not None:
            log.debug("state donor %s dropped: %s", donor, reason)
        self._wake()

    async def _open(self, donor: ID, offer: Manifest) -> DataStream:
        """A data connection to `donor`: direct TLS pinned to its certificate where we may
        dial it and it connects within `direct_timeout`, else a libp2p stream."""
        if donor not in self._no_direct:
            try:
                with trio.fail_after(self.direct_timeout):
                    stream = await connect(
                        offer.data_host,
                        offer.data_port,
                        pinned_client_context([offer.data_cert]),
                        network_key=self._network_key,
                        certificate=offer.data_cert,
                    )
                self._paths[donor] = TLS_PATH
                return stream
            except (OSError, trio.TooSlowError) as error:
                log.debug("no direct path to state donor %s: %r; trying libp2p", donor, error)
                self._no_direct.add(donor)
        stream = await open_stream(self.node.host, donor, STATE_PROTOCOL)
        self._paths[donor] = STREAM_PATH
        log.debug("fetching from state donor %s over libp2p", donor)
        return stream

    async def _pull(
        self, nursery: trio.Nursery, donor: ID, offer: Manifest, stream: DataStream
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
            start, end = plan.manifest.chunk(index)
            await receive_into(stream, memoryview(header), self.stall_timeout)
            kind, got, length = REPLY.unpack(header)
            if kind == KIND_ERROR:
                message = bytearray(min(length, MAX_ERROR_BYTES))
                await receive_into(stream, memoryview(message), self.stall_timeout)
                raise RemoteError(f"it refused: {message.decode(errors='replace')}")
            if kind != KIND_CHUNK or got != index or length != end - start:
                raise ProtocolError(
                    f"reply (kind {kind}, chunk {got}, {length} bytes) to a request for chunk "
                    f"{index} of {end - start} bytes"
                )
            # Straight where it goes (the result, or our own tensor): no copy on the way in.
            await receive_into(stream, self._into(index), self.stall_timeout)
            plan.received(donor, index)
            nursery.start_soon(self._check, donor, index)

    async def _check(self, donor: ID, index: int) -> None:
        plan = self._plan
        assert plan is not None
        # A worker thread, so hashing overlaps receiving the next chunk.
        digest = await trio.to_thread.run_sync(chunk_hash, self._into(index), limiter=self._hashers)
        if digest == plan.manifest.hashes[index]:
            plan.verified(donor, index)
        else:
            plan.rejected(donor, index)
            self._pulls[donor].cancel()
            log.debug("chunk %d from %s failed its hash check", index, donor)
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


class Receiver(Protocol):
    """What `receive_into` reads from (a `TlsStream` or a `streamio.Libp2pStream`)."""

    async def receive_into(self, view: memoryview) -> int: ...


async def receive_into(stream: Receiver, view: memoryview, stall_timeout: float) -> None:
    """Fill `view`; DeadlineExceeded after `stall_timeout` without a byte. Lets other tasks
    run every YIELD_BYTES: a read returns at once while bytes wait in the socket, and fast
    donors keep it full, so a 4 MiB chunk held a 100 M joiner's event loop for up to 327 ms
    (TLS decrypting one record at a time beside the hashing threads)."""
    got = unyielded = 0
    with trio.CancelScope() as scope:
        while got < len(view):
            scope.deadline = trio.current_time() + stall_timeout
            count = await stream.receive_into(view[got:])
            if not count:
                raise ProtocolError(f"connection closed {got} bytes into a {len(view)}-byte read")
            got += count
            unyielded += count
            if unyielded >= YIELD_BYTES:
                unyielded = 0
                await trio.lowlevel.checkpoint()
    if scope.cancelled_caught:
        raise DeadlineExceeded(f"no bytes for {stall_timeout:.3g} s")


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
    direct_timeout: float = DIRECT_TIMEOUT,
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
        direct_timeout=direct_timeout,
    )
    return await download.run(deadline=deadline)


def _nowhere(index: int) -> memoryview:
    raise AssertionError(f"chunk {index} received with no place to go")


def _own_host(node: Node) -> str:
    """The IP others reach us at (a loopback one for a collaboration on one machine)."""
    for text in node.public_addrs():
        host = host_of(text)
        if host is not None:  # else a /dns or relayed address
            return host
    return "127.0.0.1"


def _reason(error: BaseException, stall_timeout: float) -> str:
    if isinstance(error, trio.TooSlowError):
        return f"no progress for {stall_timeout:.3g} s"
    return str(error) or repr(error)


def _ranges(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:8]))
    return shown + (f" and {len(indices) - 8} more" if len(indices) > 8 else "")


__all__ = [
    "DownloadStatistics",
    "StateDownload",
    "StateDownloadFailed",
    "download_state",
    "receive_into",
]
