"""One butterfly all-reduce round among an agreed group, over the data plane.

Every member holds the same `RoundSpec` (from matchmaking): the members sorted by peer id,
each with its data address, whether it computes (sends a contribution and wants the average),
its share (the part it reduces) and its weight, and its TLS certificate. Member k reduces
part k of the flat vector. For every computing member i and reducer j != i there is one TLS
connection, opened by i: i streams its chunks of part j; j adds them as they arrive, and as
soon as every sender still in the round has delivered a chunk, sends its average back to all
of them on their connections (reduce-scatter and all-gather overlap, chunk by chunk).

So a client-only member (share 0) only dials out, an aggregator-only member (a backbone:
weight 0, does not compute) only accepts, and the reducer's own contribution never touches
the network. Wire bytes per computing member, uncompressed: sends and receives
(1 - g_k) M + g_k M (K - 1), the model of the role solver.

Faults: a sender that sends nothing for `stall_timeout`, sends a bad chunk or a chunk out of
order, or disconnects is dropped by its reducer (a sender waits 2.5 stall timeouts for an
average, since the reducer may be waiting one out for another sender): it leaves every chunk of
that part not averaged yet, even those it delivered (`reduce.py`); the chunks already sent out
keep it. A reducer that fails leaves its missing chunks at each member's local values; nothing
outlives `deadline`. A reducer sends every member the same bytes, and applies the decoded
bytes to itself, so all members that got a chunk hold the identical value for it.

Threads. Every pass over values (encode, decode, the finiteness checks, the weighted sums,
writing averages into the vector) runs in a worker thread (`trio.to_thread`, at most
`WORKER_THREADS` at a time per round), a few chunks per call (`BATCH_CHUNKS`: the chunks that
queued up while the last call ran): the event loop only moves bytes and keeps the books, so no
loop iteration does a chunk's arithmetic however large the vector (the reducer's own part of a
400 MB vector used to be encoded and decoded in one go on the loop: a second without a
heartbeat). Each call touches only its chunks (`reduce.py`); the loop books the results right
after it returns, with no checkpoint in between, so a cancelled round never holds a written
chunk it did not record. A connection's reader checks frames and hands them on; what it read
before a failure is still added or placed. `none` sends the vector's own bytes: nothing to
move off the loop there. Memory is a few chunks per connection and sender (buffers reused
chunk after chunk: fresh pages cost the kernel's zeroing), never a copy of the vector (only an
aggregator-only member with `none` sums in a part-sized buffer: it sends its averages from it).

Exactness. Every average names the senders it includes (its include mask, `wire.py`), and a
member checks it: one that leaves the member out, or is not a mask over the spec's computing
members, is that reducer failing. A round's result is *exact over S* (`RoundReport.exact_over`)
when every chunk of every part came back including the same set S of computing members (then
S holds this member, which every reducer must include, and each chunk is the weighted mean over
S, normalised by S's weights: identical on every member that got every chunk), and, if this
member reduces a part, every remote member of S confirmed it received the whole part
(`wire.RECEIVED`): members of S without it would retry without us, and step on another
average than ours. `complete` says that nobody was dropped and no reducer failed us. A member
whose round is not exact can retry at once without the members it saw fail (`retry_spec`,
`RoundReport.excluded`; the averager decides, `averager.reduce_in_group`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import os
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

import msgspec
import numpy as np
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from peer.averaging.compression import CODECS, BadPart, Codec
from peer.averaging.moshpit import MAX_BASIS_BYTES
from peer.averaging.partition import chunk_ranges, part_ranges, valid_shares
from peer.averaging.reduce import ChunkResult, PartReducer, ResultAssembler
from peer.averaging.wire import (
    ACCEPT,
    DONE,
    MAX_HELLO_BYTES,
    RECEIVED,
    Channel,
    Hello,
    include_mask,
    included_by,
    mask_bytes,
    receive_exactly,
    receive_frame,
    send_frame,
)
from peer.errors import DECODE_ERRORS, ProtocolError, first_error
from peer.net.admission import Admission, AdmissionLimits, check_dial_address, connect
from peer.net.host import Node
from peer.net.streamio import (
    ALLREDUCE_PROTOCOL,
    DIRECT_TIMEOUT,
    STREAM_PATH,
    TLS_PATH,
    DataStream,
    Libp2pStream,
    StreamGate,
    StreamLimits,
    open_stream,
)
from peer.net.tls import MAX_CERT_BYTES, DataIdentity, TlsStream, certificate_peer_id
from peer.roles.shares import cap_shares

log = logging.getLogger("peertrain.allreduce")

MAX_MEMBERS = 256  # what a leader may list, whatever it claims (matchmaking's MAX_JOINERS)
MAX_QUEUED_CHUNKS = 8  # a sender's chunks waiting for their turn before we stop reading it
REDIAL_FIRST, REDIAL_MAX = 0.01, 0.25  # a reducer that has not opened the round: dial again
# Threads a round's numeric work may use at once: numpy and torch release the GIL, so they run
# beside the loop's TLS (which releases it too); more would only queue on a small machine.
WORKER_THREADS = max(1, min(4, os.cpu_count() or 1))
FINITE_CHECK_ELEMENTS = 1 << 20  # the up-front finiteness check, per piece (4 MiB)
# Chunks per worker-thread call at most. A call hands off to a thread and back: 0.05 ms of CPU
# on an idle machine, 0.3-0.4 ms with four peers on two cores (wake-ups across cores, in a VM),
# more than a 1 MiB chunk's pass. Chunks that queue up while a call runs go in the next one.
BATCH_CHUNKS = 4
T = TypeVar("T")
# Errors of a data-plane connection that end it (and drop its peer from the round).
CONNECTION_ERRORS = (ProtocolError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)

PeerId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Share = Annotated[float, msgspec.Meta(ge=0, le=1e15)]  # msgspec rejects NaN against bounds


@dataclass(frozen=True, kw_only=True)
class Member:
    peer_id: PeerId
    host: Annotated[str, msgspec.Meta(max_length=64)]
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)]
    """Its data address; port 0: it has none (not reachable): members reach it over a libp2p
    stream (`peer.net.streamio`)."""
    computes: bool
    share: Share
    weight: Share
    cert: Annotated[bytes, msgspec.Meta(max_length=MAX_CERT_BYTES)]
    """Its data-plane TLS certificate (`peer.net.tls`): it names `peer_id`, checked before use."""
    block: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    """Contributions are added in the order of (block, peer id): the same order in every group
    that holds the same blocks, so their averages are bit-identical (`moshpit.py`)."""
    basis: Annotated[bytes, msgspec.Meta(max_length=MAX_BASIS_BYTES)] = b""
    """In a round of a Moshpit plan of several: the peers its value stands for (a mask over the
    plan's peers, `moshpit.basis_mask`), from which every member checks the seats."""

    @property
    def has_data_address(self) -> bool:
        return self.port != 0


@dataclass(frozen=True, kw_only=True)
class RoundSpec:
    round_id: Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)]
    members: Annotated[tuple[Member, ...], msgspec.Meta(min_length=1, max_length=MAX_MEMBERS)]
    """Sorted by peer id."""
    size: Annotated[int, msgspec.Meta(ge=0, le=2**40)]
    """Elements of the flat float32 vector."""
    codec: Annotated[str, msgspec.Meta(max_length=32)]
    chunk_elements: Annotated[int, msgspec.Meta(ge=1, le=2**28)]
    view: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    """The digest of the tickets the group planned from (`group.view_digest`)."""

    def parts(self) -> list[tuple[int, int]]:
        """Member k's part, in whole chunks (the same chunk boundaries in every group)."""
        return part_ranges(self.size, [m.share for m in self.members], unit=self.chunk_elements)


@dataclass
class RoundReport:
    chunks: list[ChunkResult]
    """This member's vector, chunk by chunk: which contributions each value averages."""
    computing: tuple[str, ...] = ()
    """The spec's computing members, in spec order."""
    dropped_senders: dict[str, str] = field(default_factory=dict)
    """As a reducer: senders it stopped waiting for, and why."""
    failed_reducers: dict[str, str] = field(default_factory=dict)
    """As a sender: reducers whose part it did not fully get back, and why."""
    undelivered: dict[str, str] = field(default_factory=dict)
    """As a reducer: senders still in the round that did not confirm they got our whole part."""
    silent: set[str] = field(default_factory=set)
    """Members that sent us nothing at all while others did: senders dropped holding no chunk
    of our part, reducers that returned no chunk of theirs (`peer.averaging.probation`'s
    evidence)."""
    bytes_sent: int = 0
    """Data-plane bytes this member put on the wire (frame headers included, TLS not)."""
    bytes_received: int = 0
    reduced: float = 0.0
    """The fraction of the vector this member reduced (its part, by the spec's shares)."""
    seconds: float = 0.0
    """How long the round took here, from its start to its report."""
    reducer_paths: dict[str, str] = field(default_factory=dict)
    """How our connection to each reducer went: `TLS_PATH` (direct TCP) or `STREAM_PATH` (a
    libp2p stream: it has no data address, or its address connects nowhere)."""
    sender_paths: dict[str, str] = field(default_factory=dict)
    """As a reducer: how each sender's connection came in."""

    @property
    def complete(self) -> bool:
        """Every sender delivered and every reducer returned its whole part (to us)."""
        return not self.dropped_senders and not self.failed_reducers

    @property
    def agreed(self) -> frozenset[str] | None:
        """S if every chunk came back including the same senders S (our values are then the
        weighted mean over S, whoever holds our part); None otherwise."""
        sets = {chunk.included for chunk in self.chunks}
        if len(sets) != 1:
            return None
        (included,) = sets
        return included or None

    @property
    def exact_over(self) -> frozenset[str] | None:
        """S if our vector is exact over S (module doc): `agreed`, and every remote member of S
        holds our part; None otherwise."""
        return None if self.undelivered else self.agreed

    def excluded(self) -> frozenset[str]:
        """Whom a retry leaves out: the computing members missing from a chunk we got, the
        reducers that failed us, the senders we dropped and those that did not confirm our
        part. Members that saw the same failures name the same ones (the chunks are the same
        bytes for everyone)."""
        missing = {
            peer_id
            for chunk in self.chunks
            if chunk.included
            for peer_id in self.computing
            if peer_id not in chunk.included
        }
        return frozenset(
            missing
            | self.failed_reducers.keys()
            | self.dropped_senders.keys()
            | self.undelivered.keys()
        )


@dataclass(frozen=True)
class Handoff:
    """An accepted connection passed to its round; the round sets `released` when done with
    it (trio closes a served stream when its handler returns, so the handler waits)."""

    sender: str
    stream: DataStream
    path: str = TLS_PATH
    released: trio.Event = field(default_factory=trio.Event)


@dataclass(frozen=True)
class _Inbox:
    send: trio.MemorySendChannel[Handoff]
    receive: trio.MemoryReceiveChannel[Handoff]
    certificates: dict[str, bytes]
    """The senders this round takes, by peer id, and the certificate each must present."""


class DataServer:
    """Accepts data-plane connections and hands each to the round it belongs to.

    A connection holds an admission slot (`peer.net.admission`) until it has proved the network
    key, finished TLS with a certificate we trust and said which round and member it is; one
    for a round that is not open (yet) is closed, and its member dials again. Nothing waits
    here for a round to open, so no stranger can fill a queue that members need.

    With a `node`, members with no direct path reach us over a libp2p stream
    (`ALLREDUCE_PROTOCOL`), and we them: a stream from a peer that no open round lists as a
    sender is reset before a byte of it is read; the others get a slot of `stream_limits` until
    their hello, which must name the stream's authenticated peer id. `direct_timeout` bounds
    one direct dial before a stream is tried instead.
    """

    def __init__(
        self,
        identity: DataIdentity,
        *,
        network_key: bytes | None = None,
        limits: AdmissionLimits | None = None,
        node: Node | None = None,
        stream_limits: StreamLimits | None = None,
        direct_timeout: float = DIRECT_TIMEOUT,
    ) -> None:
        self.identity = identity
        self.network_key = network_key
        self.admission = Admission(network_key, limits)
        self.node = node
        self.direct_timeout = direct_timeout
        self.stream_gate = StreamGate(stream_limits)
        self.paths: dict[str, int] = {TLS_PATH: 0, STREAM_PATH: 0}
        """Connections made or accepted per path, since we started (for status views)."""
        self._rounds: dict[bytes, _Inbox] = {}
        if node is not None:
            node.host.set_stream_handler(ALLREDUCE_PROTOCOL, self._handle_stream)

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on (host, port); reports the bound port to `nursery.start`."""
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(self.admission.serve, host=host), self._handle, port
            )
            task_status.started(listeners[0].socket.getsockname()[1])

    def open_inbox(
        self, round_id: bytes, certificates: dict[str, bytes]
    ) -> trio.MemoryReceiveChannel[Handoff]:
        """Take connections of this round from the senders in `certificates` (checked ones)."""
        self.identity.trust(list(certificates.values()))
        send, receive = trio.open_memory_channel[Handoff](math.inf)
        self._rounds[round_id] = _Inbox(send, receive, certificates)
        return receive

    def close_inbox(self, round_id: bytes) -> None:
        """The round is over: release what it never took."""
        inbox = self._rounds.pop(round_id, None)
        if inbox is None:
            return
        inbox.send.close()
        while True:
            try:
                inbox.receive.receive_nowait().released.set()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return

    async def _handle(self, stream: trio.SocketStream) -> None:
        # One connection's failure is that connection's: nothing may reach serve_tcp, which
        # would end the server (out of descriptors, a round closing under a late hello, ...).
        try:
            await self._serve_connection(stream)
        except (*CONNECTION_ERRORS, trio.TooSlowError) as error:
            log.debug("data connection ended: %r", error)

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        admitted = await self.admission.accept(stream, self.identity.server, _read_hello)
        if admitted is None:
            return
        tls, hello = admitted
        async with tls:
            await self._hand_off(tls, hello)

    async def _hand_off(self, tls: TlsStream, hello: Hello) -> None:
        inbox = self._rounds.get(hello.round_id)
        if inbox is None or inbox.certificates.get(hello.sender) != tls.peer_certificate():
            return  # not (yet) a round of ours, or not that member's certificate: hang up
        await self._pass_to_round(inbox, hello, Handoff(hello.sender, tls, TLS_PATH))

    async def _pass_to_round(self, inbox: _Inbox, hello: Hello, handoff: Handoff) -> None:
        await handoff.stream.send_all(ACCEPT)
        if self._rounds.get(hello.round_id) is not inbox:
            return  # the round ended while we answered: its member hears a hang-up
        self.paths[handoff.path] += 1
        inbox.send.send_nowait(handoff)
        await handoff.released.wait()

    # ------------------------------------------------------------ over libp2p streams

    def _expects(self, peer_id: str) -> bool:
        """Whether an open round takes a sender's connection from `peer_id`."""
        return any(peer_id in inbox.certificates for inbox in self._rounds.values())

    async def _handle_stream(self, raw: INetStream) -> None:
        # Runs in the libp2p connection's task: nothing may escape it.
        stream = Libp2pStream(raw)
        try:
            await self._serve_stream(stream)
        except (*CONNECTION_ERRORS, trio.TooSlowError) as error:
            log.debug("data stream from %s ended: %r", stream.remote_peer_id, error)
        finally:
            await stream.aclose()

    async def _serve_stream(self, stream: Libp2pStream) -> None:
        """A sender's stream: refused unless an open round lists its authenticated peer id,
        then its hello (within the gate's deadline) must name that peer and such a round."""
        peer = stream.remote_peer_id
        sender = peer.to_base58()
        if stream.relayed or not self._expects(sender):
            await stream.reset()  # not a sender of ours (yet): costs a reset, nothing more
            return
        hello = None
        with self.stream_gate.slot(peer) as scope:
            if scope is not None:
                with scope:
                    hello = await _read_stream_hello(stream)
        if hello is None or hello.sender != sender:
            if hello is not None:
                log.debug("a data stream from %s says it is from %s", sender, hello.sender)
            await stream.reset()
            return
        inbox = self._rounds.get(hello.round_id)
        if inbox is None or sender not in inbox.certificates:
            await stream.reset()  # not (yet) a round of ours, or not one of its senders
            return
        await self._pass_to_round(inbox, hello, Handoff(sender, stream, STREAM_PATH))


async def _read_hello(tls: DataStream) -> Hello:
    frame = await receive_frame(tls, max_bytes=MAX_HELLO_BYTES)
    return msgspec.msgpack.decode(bytes(frame or b""), type=Hello)


async def _read_stream_hello(stream: Libp2pStream) -> Hello | None:
    """A stream's hello; None if it is malformed or the stream ended first."""
    try:
        return await _read_hello(stream)
    except (ProtocolError, *DECODE_ERRORS) as error:
        log.debug("a bad hello on a data stream from %s: %r", stream.remote_peer_id, error)
        return None


def check_spec(spec: RoundSpec, me: str) -> None:
    """ProtocolError (saying what the spec does wrong) unless every member of a leader's spec
    is usable by us: listed once, us included, its certificate naming it, its address
    dialable, and shares and weights that cut the vector."""
    ids = [m.peer_id for m in spec.members]
    if me not in ids:
        raise ProtocolError("leaves us out")
    if len(set(ids)) != len(ids):
        raise ProtocolError("lists a member twice")
    if spec.codec not in CODECS:
        raise ProtocolError(f"names an unknown codec {spec.codec!r}")
    if not valid_shares([m.share for m in spec.members]) or not all(
        math.isfinite(m.weight) and m.weight >= 0 for m in spec.members
    ):
        raise ProtocolError("has shares or weights that are not finite and >= 0, or no reducer")
    own = next(m for m in spec.members if m.peer_id == me)
    for member in spec.members:
        if certificate_peer_id(member.cert) != member.peer_id:
            raise ProtocolError(f"lists another peer's certificate for {member.peer_id}")
        if member.peer_id != me and member.has_data_address:  # else: over libp2p
            check_dial_address(member.host, member.port, own_host=own.host)


def retry_spec(spec: RoundSpec, excluded: Collection[str]) -> RoundSpec:
    """The spec of an immediate retry of `spec` without `excluded` and without its
    aggregator-only members (they see only their own part, so they cannot tell whom the others
    leave out: they sit retries out): the other members as they were, their shares capped
    again among the reducers left (`cap_shares`: dropping a reducer must not lift another
    above the cap), and a round id derived from both, so that only members that left out the
    same peers meet. It may not pass `check_spec` (nobody left to reduce, say): check it."""
    # Only contributors name the retry: members that disagree on whether an aggregator-only
    # member failed them still meet (it is left out either way).
    left_out = sorted({m.peer_id for m in spec.members if m.computes} & set(excluded))
    members = tuple(m for m in spec.members if m.peer_id not in left_out and m.computes)
    digest = hashlib.blake2b(digest_size=16)
    for part in (b"peertrain/retry/1", spec.round_id, *(p.encode() for p in left_out)):
        digest.update(len(part).to_bytes(4, "big") + part)
    shares = [m.share for m in members]
    if valid_shares(shares):
        capped = cap_shares(shares, [g > 0 for g in shares])
        members = tuple(
            dataclasses.replace(m, share=g) for m, g in zip(members, capped, strict=True)
        )
    return dataclasses.replace(spec, round_id=digest.digest(), members=members)


async def dial_reducer(server: DataServer, round_id: bytes, reducer: Member) -> TlsStream:
    """One try at a connection to `reducer` for our part in round `round_id`: admission, TLS
    pinned to the reducer's certificate, our hello, its accept. ProtocolError if it hangs up
    (a round it has not opened) or presents another certificate; OSError if unreachable."""
    tls = await connect(
        reducer.host,
        reducer.port,
        server.identity.client,
        network_key=server.network_key,
        certificate=reducer.cert,
    )
    try:
        await _greet_reducer(tls, round_id, server.identity.peer_id)
    except BaseException:
        with trio.CancelScope(shield=True):
            await tls.aclose()
        raise
    return tls


async def dial_reducer_stream(server: DataServer, round_id: bytes, reducer: Member) -> DataStream:
    """One try at a libp2p stream to `reducer` (`ALLREDUCE_PROTOCOL`) for our part in round
    `round_id`: our hello, its accept. The stream is authenticated by the libp2p connection's
    Noise handshake, so no TLS inside. ProtocolError if it hangs up (a round it has not
    opened); OSError if no stream can be opened (no node, no connection)."""
    if server.node is None:
        raise OSError(f"no libp2p node to reach {reducer.peer_id} without a direct path")
    stream = await open_stream(
        server.node.host, ID.from_base58(reducer.peer_id), ALLREDUCE_PROTOCOL
    )
    try:
        await _greet_reducer(stream, round_id, server.identity.peer_id)
    except BaseException:
        await stream.reset()
        raise
    return stream


async def _greet_reducer(stream: DataStream, round_id: bytes, me: str) -> None:
    await send_frame(stream, msgspec.msgpack.encode(Hello(round_id, me)))
    answer = bytearray(len(ACCEPT))
    if not await receive_exactly(stream, memoryview(answer)) or answer != ACCEPT:
        raise ProtocolError("the reducer hung up on our hello")


async def allreduce(
    spec: RoundSpec,
    vector: np.ndarray,
    server: DataServer,
    *,
    deadline: float,
    stall_timeout: float,
    norm_factor: float | None = None,
) -> RoundReport:
    """Average `vector` (float32, flat, updated in place) with the group; see the module doc.

    `spec` must have passed `check_spec`. `deadline` is a `trio.current_time()` value;
    `stall_timeout` bounds each wait for a peer. With a `norm_factor` the part this member
    reduces is averaged robustly (`peer.averaging.robust`): the choice is each reducer's own.
    """
    me = server.identity.peer_id
    index = next(i for i, m in enumerate(spec.members) if m.peer_id == me)
    senders = {m.peer_id: m.cert for m in spec.members if m.computes and m.peer_id != me}
    server.identity.trust([m.cert for m in spec.members if m.peer_id != me])
    inbox = server.open_inbox(spec.round_id, senders)
    round_: _Round | None = None
    try:
        round_ = _Round(spec, index, server, vector, stall_timeout, norm_factor)
        return await round_.run(inbox, deadline)
    finally:
        server.close_inbox(spec.round_id)
        if round_ is not None:
            round_.release()


class _Round:
    def __init__(
        self,
        spec: RoundSpec,
        index: int,
        server: DataServer,
        vector: np.ndarray,
        stall_timeout: float,
        norm_factor: float | None,
    ) -> None:
        if vector.dtype != np.float32 or vector.shape != (spec.size,):
            raise ValueError(
                f"vector is {vector.dtype}{vector.shape}, expected float32({spec.size},)"
            )
        self.spec = spec
        self.me = spec.members[index]
        self.index = index
        self.server = server
        self.vector = vector
        self.stall_timeout = stall_timeout
        self.norm_factor = norm_factor
        self.codec = CODECS[spec.codec]
        self.parts = spec.parts()
        self.computing = tuple(m.peer_id for m in spec.members if m.computes)  # mask positions
        lo, hi = self.parts[index]
        self.report = RoundReport(
            chunks=[], computing=self.computing, reduced=(hi - lo) / max(spec.size, 1)
        )
        self.assembler = (
            ResultAssembler(vector, self.parts, chunk_elements=spec.chunk_elements)
            if self.me.computes
            else None
        )
        self.part: _PartService | None = None
        self.channels: list[Channel] = []
        self.limiter = trio.CapacityLimiter(WORKER_THREADS)

    def release(self) -> None:
        """Let go of the round's vectors and buffers once it is over. Its tasks' frames can
        outlive it in reference cycles (a cancelled task's traceback holds them), which only
        a full garbage collection frees: at 100 M parameters 2-3 finished rounds' vectors
        and sums (0.8-1.7 GB) were alive at any time."""
        self.vector = np.empty(0, np.float32)
        if self.assembler is not None:
            self.assembler.release()
        if self.part is not None:
            self.part.reducer.release()
            self.part.spare.clear()
            self.part.lent.clear()

    async def off_loop(self, fn: Callable[[], T]) -> T:
        """fn() in a worker thread. Not abandoned on cancel (the default): a chunk's pass ends
        (in milliseconds) before the round does, so nothing writes a vector after its round."""
        return await trio.to_thread.run_sync(fn, limiter=self.limiter)

    async def run(self, inbox: trio.MemoryReceiveChannel, deadline: float) -> RoundReport:
        started = trio.current_time()
        lo, hi = self.parts[self.index]
        if self.me.computes and not await self.off_loop(lambda: _all_finite(self.vector)):
            raise ValueError("the local vector holds NaN or Inf: it cannot be averaged")
        with trio.move_on_at(deadline):
            async with trio.open_nursery() as nursery:
                if hi > lo:
                    self.part = _PartService(self)
                    nursery.start_soon(self.part.run, inbox)
                if self.me.computes:
                    for j, member in enumerate(self.spec.members):
                        start, end = self.parts[j]
                        if j != self.index and end > start:
                            nursery.start_soon(self._send_to, j, member)
        for j, member in enumerate(self.spec.members):
            if self._owes_me(j):
                self.report.failed_reducers.setdefault(member.peer_id, "the deadline passed")
        if self.part is not None:
            for sender in self.part.reducer.waiting_for():
                self.report.dropped_senders.setdefault(sender, "the deadline passed")
            for sender in sorted(
                self.part.remote - self.part.received - {*self.report.dropped_senders}
            ):
                self.report.undelivered[sender] = "did not confirm it got our whole part"
        if self.assembler is not None:
            self.report.chunks = self.assembler.report()
        self.report.silent = self._silent()
        self.report.bytes_sent += sum(c.bytes_sent for c in self.channels)
        self.report.bytes_received += sum(c.bytes_received for c in self.channels)
        self.report.seconds = trio.current_time() - started
        return self.report

    def _silent(self) -> set[str]:
        """Members that sent us nothing at all while others did (`RoundReport.silent`): senders
        we dropped holding no chunk of our part while another sender delivered some, reducers
        that returned no chunk of theirs while another returned its whole part. A member that
        delivered part of it was slowed (perhaps by another, held back in lock-step), and
        when nobody delivered, the fault may be ours."""
        silent: set[str] = set()
        me = self.me.peer_id
        if self.part is not None:
            reducer = self.part.reducer
            total = len(reducer.chunks)
            nothing = {s for s, left in reducer.pending.items() if s != me and len(left) == total}
            delivered = set(reducer.pending) - nothing - {me}
            if total and delivered:
                silent |= nothing & set(self.report.dropped_senders)
        if self.assembler is not None:
            assembler = self.assembler
            mine = [j for j, (lo, hi) in enumerate(self.parts) if j != self.index and hi > lo]

            def returned_any(j: int) -> bool:
                return any((j, i) in assembler.received for i in range(len(assembler.chunks[j])))

            if any(assembler.part_complete(j) for j in mine):
                silent |= {
                    self.spec.members[j].peer_id
                    for j in mine
                    if self.spec.members[j].peer_id in self.report.failed_reducers
                    and not returned_any(j)
                }
        return silent

    def _owes_me(self, j: int) -> bool:
        """Reducer j has not (yet) returned all of its part to us."""
        start, end = self.parts[j]
        return (
            self.assembler is not None
            and j != self.index
            and end > start
            and not self.assembler.part_complete(j)
        )

    # ------------------------------------------------------------------ as a sender

    async def _send_to(self, j: int, reducer: Member) -> None:
        """Stream our chunks of part j to its reducer and take the averages back."""
        assert self.assembler is not None
        try:
            with trio.fail_after(self.stall_timeout):
                stream = await self._connect(reducer)
            async with stream:
                channel = Channel(stream)
                self.channels.append(channel)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._send_chunks, channel, j)
                    await self._receive_averages(channel, j)
        except* (trio.TooSlowError, *CONNECTION_ERRORS) as group:
            error = first_error(group)  # the error that ended the connection
            self.report.failed_reducers[reducer.peer_id] = _reason(error)
            log.debug("reducer %s failed: %r", reducer.peer_id, error)

    async def _connect(self, reducer: Member) -> DataStream:
        """A connection the reducer accepted for this round: direct (TLS) where it has a data
        address that connects, else a libp2p stream. It hangs up on a round it has not opened
        yet (it may not have the spec): dial again, backing off, until the caller's deadline.
        A direct dial that fails to connect (refused, unreachable, no answer within
        `direct_timeout`) gives way to streams for the rest of the round; a hang-up does not."""
        server = self.server
        direct = reducer.has_data_address
        delay = REDIAL_FIRST
        while True:
            path = TLS_PATH if direct else STREAM_PATH
            try:
                if direct:
                    stream = await self._dial_direct(reducer)
                    if stream is None:
                        direct = False
                        continue
                else:
                    stream = await dial_reducer_stream(server, self.spec.round_id, reducer)
                hello = Hello(self.spec.round_id, self.me.peer_id)
                self.report.bytes_sent += 4 + len(msgspec.msgpack.encode(hello))
                self.report.bytes_received += len(ACCEPT)
                self.report.reducer_paths[reducer.peer_id] = path
                server.paths[path] += 1
                log.debug("connected to reducer %s over %s", reducer.peer_id, path)
                return stream
            except CONNECTION_ERRORS as error:
                log.debug("dialing reducer %s again (%s): %r", reducer.peer_id, path, error)
            await trio.sleep(delay)
            delay = min(2 * delay, REDIAL_MAX)

    async def _dial_direct(self, reducer: Member) -> TlsStream | None:
        """`dial_reducer`, or None where there is no direct path to it and a node to reach it
        by stream (its address refuses or drops the connection)."""
        if self.server.node is None:
            return await dial_reducer(self.server, self.spec.round_id, reducer)
        try:
            with trio.fail_after(self.server.direct_timeout):
                return await dial_reducer(self.server, self.spec.round_id, reducer)
        except (OSError, trio.TooSlowError) as error:
            log.debug("no direct path to reducer %s: %r; trying libp2p", reducer.peer_id, error)
            return None

    async def _send_chunks(self, channel: Channel, j: int) -> None:
        start, end = self.parts[j]
        chunks = chunk_ranges(start, end, self.spec.chunk_elements)
        if self.codec.transforms:
            await self._send_encoded(channel, chunks)
        else:  # the vector's own bytes: nothing to compute
            for index, (lo, hi) in enumerate(chunks):
                await channel.send(index, 0, self.codec.encode(self.vector[lo:hi]))
        await channel.send(DONE, 0, b"")

    async def _send_encoded(self, channel: Channel, chunks: list[tuple[int, int]]) -> None:
        """Encode a few chunks per worker-thread call while the few before go out: two sets
        of buffers take turns (a set is encoded into again once its bytes are sent, copied
        into TLS)."""
        codec, size = self.codec, min(BATCH_CHUNKS, len(chunks))
        free_send, free = trio.open_memory_channel[list[np.ndarray]](2)
        for _ in range(2):
            wire = codec.wire_bytes(self.spec.chunk_elements)
            free_send.send_nowait([np.empty(wire, np.uint8) for _ in range(size)])
        encoded_send, encoded = trio.open_memory_channel[_Encoded](0)

        async def encode_all() -> None:
            async with encoded_send:
                for first in range(0, len(chunks), size):
                    buffers = await free.receive()
                    payloads = await self.off_loop(
                        functools.partial(
                            _encode_chunks,
                            codec,
                            self.vector,
                            chunks[first : first + size],
                            buffers,
                        )
                    )
                    await encoded_send.send((first, payloads, buffers))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(encode_all)
            async for first, payloads, buffers in encoded:
                for offset, payload in enumerate(payloads):
                    await channel.send(first + offset, 0, payload)
                free_send.send_nowait(buffers)

    async def _receive_averages(self, channel: Channel, j: int) -> None:
        """Read reducer j's averages and check their frames; `_place_averages` decodes them
        into our vector meanwhile, a few per worker-thread call."""
        frames_send, frames = trio.open_memory_channel[_Average](BATCH_CHUNKS)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._place_averages, frames, j)
            async with frames_send:
                failure = await _failure_of(self._read_averages(channel, j, frames_send))
        if failure is not None:  # raised once what came before it is in our vector
            raise failure
        # We hold the whole part: say so (the reducer counts its part delivered to us only
        # then), and read the end marker too (hanging up before it would reset the reducer's
        # last send). The part is complete either way: a failure here is no failure of it.
        with trio.move_on_after(self.stall_timeout), suppress(*CONNECTION_ERRORS):
            await channel.send(RECEIVED, 0, b"")
            await channel.receive(max_payload=0)

    async def _read_averages(
        self, channel: Channel, j: int, frames_send: trio.MemorySendChannel[_Average]
    ) -> None:
        assert self.assembler is not None
        assembler = self.assembler
        chunks = assembler.chunks[j]
        mask = mask_bytes(len(self.computing))
        max_payload = mask + self.codec.wire_bytes(self.spec.chunk_elements)
        seen: set[int] = set()
        while len(seen) < len(chunks):
            # An average waits for the part's slowest sender, whom the reducer gives up on
            # after its own stall timeout (checked every quarter of it): allow for that too.
            with trio.fail_after(2.5 * self.stall_timeout):
                frame = await channel.receive(max_payload=max_payload)
            if frame is None:
                raise BadPart("the reducer closed the connection before its part was complete")
            index, senders, payload = frame
            if index == DONE:
                raise BadPart("the reducer ended its part early")
            if not 0 <= index < len(chunks):
                raise BadPart(f"chunk {index} is out of range")
            if index in seen:
                raise BadPart(f"chunk {index} of part {j} came twice")
            lo, hi = chunks[index]
            due = mask + self.codec.wire_bytes(hi - lo)
            if len(payload) != due:
                raise BadPart(f"chunk {index} is {len(payload)} bytes, not {due} (mask and values)")
            view = memoryview(payload)
            included = included_by(view[:mask], self.computing)
            if len(included) != senders:
                raise BadPart(f"chunk {index} names {len(included)} senders but counts {senders}")
            if self.me.peer_id not in included:
                raise BadPart(f"chunk {index} leaves our contribution out")
            assembler.check(j, index, included)
            seen.add(index)
            await frames_send.send((index, included, view[mask:]))

    async def _place_averages(self, frames: trio.MemoryReceiveChannel[_Average], j: int) -> None:
        assert self.assembler is not None
        assembler = self.assembler
        decoded = np.empty(self.spec.chunk_elements, np.float32)  # this connection's, reused
        while batch := await _next_batch(frames):
            placed, error = await self.off_loop(
                functools.partial(_write_averages, self.codec, assembler, j, batch, decoded)
            )
            for index, included, _ in batch[:placed]:
                assembler.record(j, index, included)  # no checkpoint since the writes
            if error is not None:
                raise error


class _PartService:
    """Member k's side as the reducer of part k: takes every sender's connection, adds the
    chunks as they arrive and sends each average out as soon as its chunk is complete."""

    def __init__(self, round_: _Round) -> None:
        self.round = round_
        spec, me = round_.spec, round_.me
        lo, hi = round_.parts[round_.index]
        self.lo = lo
        self.members = {m.peer_id: m for m in spec.members}
        computing = sorted(
            (m for m in spec.members if m.computes), key=lambda m: (m.block, m.peer_id)
        )
        senders = {m.peer_id: m.weight for m in computing}
        self.reducer = PartReducer(
            lo,
            hi,
            chunk_elements=spec.chunk_elements,
            weights=senders,
            order=[m.peer_id for m in computing],
            norm_factor=round_.norm_factor,
        )
        self.remote = set(senders) - {me.peer_id}
        self.connected: set[str] = set()
        self.received: set[str] = set()  # senders that confirmed they hold our whole part
        self.outboxes: dict[str, trio.MemorySendChannel] = {}
        self.to_average: deque[int] = deque()  # settled chunks, for `_publish_averages`
        # Chunk buffers that contributions are decoded into (fp16, int8), reused once added.
        self.spare: list[np.ndarray] = []
        self.lent: dict[int, list[np.ndarray]] = {}  # per chunk index, until it is averaged
        self.wake_publisher = trio.Event()
        self.all_averaged = trio.Event()  # every chunk averaged (or given up)
        self.idle = trio.Event()  # no connection is being served (renewed when one starts)
        self.idle.set()
        self.active = 0
        self.progressed = trio.Event()  # set (and renewed) whenever contributions were added

    async def run(self, inbox: trio.MemoryReceiveChannel) -> None:
        round_, reducer = self.round, self.reducer
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._publish_averages)
            if round_.me.computes:
                nursery.start_soon(self._contribute)
            nursery.start_soon(self._accept, inbox, nursery)
            self.publish()
            while not reducer.done:  # a watchdog for senders that never connect
                with trio.move_on_after(round_.stall_timeout / 4):
                    await self.all_averaged.wait()
                if trio.current_time() - started >= round_.stall_timeout:
                    absent = set(reducer.waiting_for()) - self.connected - {round_.me.peer_id}
                    for peer_id in absent:
                        self.drop(peer_id, f"did not connect within {round_.stall_timeout:.3g}s")
                self.publish()
            await self.all_averaged.wait()  # the last settled chunks are averaged and queued
            with trio.move_on_after(round_.stall_timeout):
                while self.active:  # the last averages leave
                    await self.idle.wait()
            nursery.cancel_scope.cancel()

    async def _accept(
        self, inbox: trio.MemoryReceiveChannel[Handoff], nursery: trio.Nursery
    ) -> None:
        async for handoff in inbox:
            sender = handoff.sender
            if (
                sender not in self.remote
                or sender in self.connected
                or sender in self.reducer.dropped
            ):
                handoff.released.set()
                continue
            if not self.active:
                self.idle = trio.Event()
            self.active += 1
            nursery.start_soon(self._serve, handoff)

    def drop(self, sender: str, reason: str) -> None:
        self.reducer.drop(sender, reason)
        self.round.report.dropped_senders.setdefault(sender, reason)
        self._close_outbox(sender)

    def _close_outbox(self, sender: str) -> None:
        outbox = self.outboxes.pop(sender, None)
        if outbox is not None:
            outbox.close()

    def publish(self) -> None:
        """Hand every chunk that just settled to `_publish_averages`."""
        settled = self.reducer.take_complete()
        if settled or self.reducer.done:
            self.to_average.extend(settled)
            self.wake_publisher.set()
        self._progress()

    def _progress(self) -> None:
        self.progressed.set()
        self.progressed = trio.Event()

    def _held_back(self, sender: str) -> bool:
        """Whether to stop reading `sender` for now: far ahead of the slowest sender, or too
        many settled chunks (and their contributions) wait to be averaged. Neither can
        deadlock: chunks come in order, so every chunk the slowest sender delivered has
        settled and it is never held back by the first; the averaging needs nobody."""
        return (
            self.reducer.queued[sender] >= MAX_QUEUED_CHUNKS
            or len(self.to_average) >= MAX_QUEUED_CHUNKS
        )

    async def _publish_averages(self) -> None:
        """Average the settled chunks, a few per worker-thread call, and queue each for every
        sender; when none is left to come, close the outboxes."""
        round_, reducer = self.round, self.reducer
        buffers = _ChunkBuffers(round_.codec, round_.spec.chunk_elements)
        while True:
            self.wake_publisher = trio.Event()
            while self.to_average:
                batch = [
                    self.to_average.popleft()
                    for _ in range(min(BATCH_CHUNKS, len(self.to_average)))
                ]
                results = await round_.off_loop(
                    functools.partial(_average_chunks, round_, reducer, batch, buffers)
                )
                for index, averaged in zip(batch, results, strict=True):
                    self.spare.extend(self.lent.pop(index, ()))  # its contributions are added
                    for sender, reason in reducer.unfit(index).items():
                        self.drop(sender, reason)  # left out of this chunk: out of the rest too
                    if averaged is None:
                        continue  # nobody delivered it (or int8 made it inf): keep local values
                    count, payload = averaged
                    included = reducer.included(index)
                    if round_.assembler is not None:  # no checkpoint since the write
                        round_.assembler.record(round_.index, index, included)
                    mask = include_mask(included, round_.computing)
                    for outbox in self.outboxes.values():
                        outbox.send_nowait((index, count, mask, payload))
                self.publish()  # a drop settles chunks too
            if reducer.done:
                for sender in list(self.outboxes):
                    self._close_outbox(sender)
                self.all_averaged.set()
                return
            await self.wake_publisher.wait()

    async def _contribute(self) -> None:
        """Our own contribution, chunk by chunk like a remote sender's: views of our vector
        (checked finite up front), which `_average_chunk` passes through the codec as if sent
        when it adds them (then every group adds the same bits for it)."""
        reducer, me = self.reducer, self.round.me.peer_id
        for index, (a, b) in enumerate(reducer.chunks):
            while self._held_back(me):
                await self.progressed.wait()
            if me in reducer.dropped:  # our own values decoded to inf (`reduce.unfit`)
                return
            reducer.add_checked(me, index, self.round.vector[self.lo + a : self.lo + b])
            self.publish()

    async def _serve(self, handoff: Handoff) -> None:
        sender, stream = handoff.sender, handoff.stream
        self.round.report.sender_paths[sender] = handoff.path
        try:
            async with stream:
                channel = Channel(stream)
                self.round.channels.append(channel)  # counted in the report from here on
                self.connected.add(sender)
                outbox, outgoing = trio.open_memory_channel(math.inf)
                self.outboxes[sender] = outbox
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_forward, channel, outgoing)
                        await self._take_chunks(channel, sender)
                        await self._take_receipt(channel, sender)
                except* (trio.TooSlowError, *CONNECTION_ERRORS) as group:
                    error = first_error(group)  # the error that ended the connection
                    if sender in self.reducer.waiting_for():
                        self.drop(sender, _reason(error))
                        self.publish()
                    log.debug("sender %s: %r", sender, error)
        finally:
            handoff.released.set()
            self._close_outbox(sender)
            self.active -= 1
            if not self.active:
                self.idle.set()

    async def _take_chunks(self, channel: Channel, sender: str) -> None:
        """Read a sender's chunks and check their frames; `_add_contributions` decodes and
        adds them meanwhile, a few per worker-thread call."""
        frames_send, frames = trio.open_memory_channel[tuple[int, bytearray]](BATCH_CHUNKS)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._add_contributions, frames, sender)
            async with frames_send:
                failure = await _failure_of(self._read_chunks(channel, sender, frames_send))
        if failure is not None:  # raised once what came before it is added
            raise failure
        if sender in self.reducer.waiting_for():
            raise BadPart("the sender ended before sending every chunk")

    async def _read_chunks(
        self,
        channel: Channel,
        sender: str,
        frames_send: trio.MemorySendChannel[tuple[int, bytearray]],
    ) -> None:
        round_, reducer = self.round, self.reducer
        max_payload = round_.codec.wire_bytes(round_.spec.chunk_elements)
        expected = 0
        while True:
            while self._held_back(sender):  # read on once chunks settled or averaged
                await self.progressed.wait()
            with trio.fail_after(round_.stall_timeout):
                frame = await channel.receive(max_payload=max_payload)
            if frame is None:
                raise BadPart("the sender disconnected before its last chunk")
            index, _, payload = frame
            if index == DONE:
                break
            if not 0 <= index < len(reducer.chunks):
                raise BadPart(f"chunk {index} is out of range")
            if index != expected:
                raise BadPart(f"chunk {index} came where chunk {expected} was due")
            await frames_send.send((index, payload))
            expected += 1

    async def _add_contributions(
        self, frames: trio.MemoryReceiveChannel[tuple[int, bytearray]], sender: str
    ) -> None:
        round_, reducer, codec = self.round, self.reducer, self.round.codec
        while batch := await _next_batch(frames):
            buffers: list[np.ndarray | None] = [None] * len(batch)  # `none`: views of frames
            if codec.transforms:
                buffers = [self._spare_buffer() for _ in batch]
            decoded, error = await round_.off_loop(
                functools.partial(_decode_contributions, codec, reducer, batch, buffers)
            )
            for (index, _), values, buffer in zip(batch, decoded, buffers, strict=False):
                if buffer is not None:
                    self.lent.setdefault(index, []).append(buffer)
                reducer.add_checked(sender, index, values)
            self.spare.extend(b for b in buffers[len(decoded) :] if b is not None)
            self.publish()
            if error is not None:
                raise error

    def _spare_buffer(self) -> np.ndarray:
        if self.spare:
            return self.spare.pop()
        return np.empty(self.reducer.chunk_size(0), np.float32)  # chunk 0 is the largest

    async def _take_receipt(self, channel: Channel, sender: str) -> None:
        """The sender's word that it holds our whole part (it comes after our last average:
        `run` bounds the wait)."""
        frame = await channel.receive(max_payload=0)
        if frame is None or frame[0] != RECEIVED:
            raise BadPart("the sender ended without confirming it got our part")
        self.received.add(sender)


_Encoded = tuple[int, list[memoryview], list[np.ndarray]]  # first index, wire bytes, buffers
_Average = tuple[int, frozenset[str], memoryview]  # index, senders included, codec bytes


async def _failure_of(reading: Awaitable[None]) -> BaseException | None:
    """The connection error that ended `reading`, if any. A reader hands frames on to a task
    that decodes them off the loop; returned, not raised, its error waits until that task has
    finished what was read before it (raised at once, it would cancel that work)."""
    try:
        await reading
    except (trio.TooSlowError, *CONNECTION_ERRORS) as error:
        return error
    return None


async def _next_batch(receive: trio.MemoryReceiveChannel[T]) -> list[T]:
    """The next item and what queued up behind it, BATCH_CHUNKS at most; [] at the end."""
    try:
        batch = [await receive.receive()]
    except trio.EndOfChannel:
        return []
    while len(batch) < BATCH_CHUNKS:
        try:
            batch.append(receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            break
    return batch


# ---------------------------------------------------------------- the passes over values
# Each runs in a worker thread (`_Round.off_loop`) and touches its chunks' memory only.


def _all_finite(vector: np.ndarray) -> bool:
    """np.isfinite(vector).all() in pieces: no temporary the size of the vector."""
    flags = np.empty(min(len(vector), FINITE_CHECK_ELEMENTS), dtype=bool)
    for start in range(0, len(vector), FINITE_CHECK_ELEMENTS):
        piece = vector[start : start + FINITE_CHECK_ELEMENTS]
        if not np.isfinite(piece, out=flags[: len(piece)]).all():
            return False
    return True


def _encode_chunks(
    codec: Codec, vector: np.ndarray, chunks: list[tuple[int, int]], buffers: list[np.ndarray]
) -> list[memoryview]:
    return [
        codec.encode(vector[lo:hi], out=buffer)
        for (lo, hi), buffer in zip(chunks, buffers, strict=False)
    ]


def _decode_contributions(
    codec: Codec,
    reducer: PartReducer,
    batch: list[tuple[int, bytearray]],
    buffers: list[np.ndarray | None],
) -> tuple[list[np.ndarray], BadPart | None]:
    """A sender's chunks, decoded (into `buffers`, which they keep until added; `none`: views
    of the frames) and checked, in order up to the first that is not valid (and its error)."""
    decoded = []
    for (index, payload), buffer in zip(batch, buffers, strict=True):
        try:
            values = codec.decode(payload, reducer.chunk_size(index), out=buffer)
            reducer.check(index, values)
        except BadPart as error:
            return decoded, error
        decoded.append(values)
    return decoded, None


class _ChunkBuffers:
    """The publisher's buffers, one chunk each, reused chunk after chunk."""

    def __init__(self, codec: Codec, chunk_elements: int) -> None:
        self.sum = np.empty(chunk_elements, np.float32)
        self.decoded = np.empty(chunk_elements, np.float32)  # our copy of an average, decoded
        self.own = np.empty(chunk_elements, np.float32)  # our contribution, decoded
        self.wire = np.empty(codec.wire_bytes(chunk_elements), np.uint8)


def _average_chunks(
    round_: _Round, reducer: PartReducer, indices: list[int], buffers: _ChunkBuffers
) -> list[tuple[int, memoryview] | None]:
    return [_average_chunk(round_, reducer, index, buffers) for index in indices]


def _average_chunk(
    round_: _Round, reducer: PartReducer, index: int, buffers: _ChunkBuffers
) -> tuple[int, memoryview] | None:
    """(senders, wire bytes) of settled chunk `index`'s average, written (decoded, as every
    member gets it) into our own vector if we compute; None if nobody delivered it, or the
    average, int8-encoded, decodes to inf (a value at float32's limit): then every member
    keeps its local values. The average is finite (float64 sums, `reduce.weighted_mean`): a
    contribution of ours that decodes to inf is left out, and `reducer.unfit` says so."""
    codec, assembler, me = round_.codec, round_.assembler, round_.me.peer_id

    def as_sent(sender: str, values: np.ndarray) -> np.ndarray:
        """Our own contribution as a reducer decodes it once sent."""
        if sender != me or not codec.transforms:
            return values
        wire = codec.encode(values, out=buffers.wire)
        with np.errstate(over="ignore"):  # int8 at float32's limit: inf, left out by `average`
            return codec.decode(wire, len(values), out=buffers.own)

    # Sum in a buffer unless the wire bytes are a view of the sum (`none`) and must last
    # until every sender has them: then in the reducer's sum, or straight in our vector.
    in_place = not codec.transforms and assembler is None
    average, count = reducer.average(index, out=None if in_place else buffers.sum, prepare=as_sent)
    if average is None:
        return None
    if assembler is None:
        # Finite by construction (`weighted_mean`); checked all the same before it leaves an
        # aggregator-only member, whose every member would otherwise fail it.
        if not np.isfinite(average).all():
            return None
        return count, codec.encode(average)  # fp16, int8: a new buffer, until sent
    if codec.transforms:
        payload = codec.encode(average)
        values = codec.decode(payload, len(average), out=buffers.decoded)
    else:
        values = average
    try:
        assembler.write(round_.index, index, values)
    except BadPart:  # int8 near float32's limit decodes to inf: keep local values
        return None
    if not codec.transforms:  # our vector's chunk holds the bytes: nothing writes it again
        lo, hi = assembler.chunks[round_.index][index]
        payload = codec.encode(assembler.vector[lo:hi])
    return count, payload


def _write_averages(
    codec: Codec,
    assembler: ResultAssembler,
    part: int,
    batch: list[_Average],
    decoded: np.ndarray,
) -> tuple[int, BadPart | None]:
    """Decode averages a reducer sent (into `decoded`, the connection's buffer) and write
    them into our vector, in order up to the first that is not valid (left untouched):
    (how many were written, its error)."""
    for placed, (index, _, data) in enumerate(batch):
        lo, hi = assembler.chunks[part][index]
        try:
            # `none`: a view of the frame, copied once, by `write`.
            values = codec.decode(data, hi - lo, out=decoded if codec.transforms else None)
            assembler.write(part, index, values)
        except BadPart as error:
            return placed, error
    return len(batch), None


async def _forward(channel: Channel, outgoing: trio.MemoryReceiveChannel) -> None:
    """Send the averages queued for one sender (mask first), then the end marker."""
    async for index, count, mask, payload in outgoing:
        await channel.send(index, count, payload, prefix=mask)
    await channel.send(DONE, 0, b"")


def _reason(error: BaseException) -> str:
    if isinstance(error, trio.TooSlowError):
        return "stalled"
    return str(error) or type(error).__name__
