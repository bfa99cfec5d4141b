"""One butterfly all-reduce round among an agreed group, over the data plane.

Every member holds the same `RoundSpec` (from matchmaking): the members sorted by peer id,
each with its data address, whether it computes (sends a contribution and wants the average),
its share (the part it reduces) and its weight, and its signed round key. Member k reduces
part k of the flat vector. For every computing member i and reducer j != i there is one TCP
connection, opened by i: i streams its chunks of part j; j adds them as they arrive, and as
soon as every sender still in the round has delivered a chunk, sends its average back to all
of them on their connections (reduce-scatter and all-gather overlap, chunk by chunk).

So a client-only member (share 0) only dials out, an aggregator-only member (a backbone:
weight 0, does not compute) only accepts, and the reducer's own contribution never touches
the network. Wire bytes per computing member, uncompressed: sends and receives
(1 - g_k) M + g_k M (K - 1), the model of the role solver.

Faults: a sender that sends nothing for `stall_timeout`, sends a bad chunk, or disconnects is
dropped by its reducer (a sender waits 2.5 stall timeouts for an average, since the reducer may
be waiting one out for another sender) (its delivered chunks stay averaged in, each chunk is normalised by
its own weight); a reducer that fails leaves its missing chunks at each member's local values;
nothing outlives `deadline`. A reducer sends every member the same bytes, and applies the
decoded bytes to itself, so all members that got a chunk hold the identical value for it.
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
from contextlib import suppress
from dataclasses import dataclass, field

import msgspec
import numpy as np
import trio

from peer.averaging.compression import CODECS, BadPart
from peer.averaging.crypto import ConnectionKeys, KeyAnnouncement, RoundKey
from peer.averaging.partition import chunk_ranges, part_ranges
from peer.averaging.reduce import ChunkResult, PartReducer, ResultAssembler
from peer.averaging.wire import (
    DONE,
    MAX_HELLO_BYTES,
    Hello,
    SealedChannel,
    receive_frame,
    send_frame,
)
from peer.errors import DECODE_ERRORS, ProtocolError

log = logging.getLogger("peertrain.allreduce")

MAX_EARLY_CONNECTIONS = 256  # connections waiting for their round to open, at most
MAX_EARLY_PER_ROUND = 32
MAX_PENDING_PER_SENDER = 4  # connections claiming one sender, not yet authenticated
MAX_QUEUED_CHUNKS = 8  # a sender's chunks waiting for their turn before we stop reading it
CHALLENGE_BYTES = 16
# Errors of a data-plane connection that end it (and drop its peer from the round).
CONNECTION_ERRORS = (ProtocolError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)


@dataclass(frozen=True, kw_only=True)
class Member:
    peer_id: str
    host: str
    port: int
    computes: bool
    share: float
    weight: float
    key: KeyAnnouncement
    block: int = 0
    """Contributions are added in the order of (block, peer id): the same order in every group
    that holds the same blocks, so their averages are bit-identical (`moshpit.py`)."""


@dataclass(frozen=True, kw_only=True)
class RoundSpec:
    round_id: bytes
    members: tuple[Member, ...]
    """Sorted by peer id."""
    size: int
    """Elements of the flat float32 vector."""
    codec: str
    chunk_elements: int
    view: bytes = b""
    """The digest of the tickets the group planned from (`group.view_digest`)."""

    def parts(self) -> list[tuple[int, int]]:
        """Member k's part, in whole chunks (the same chunk boundaries in every group)."""
        return part_ranges(self.size, [m.share for m in self.members], unit=self.chunk_elements)


@dataclass
class RoundReport:
    chunks: list[ChunkResult]
    """This member's vector, chunk by chunk: how many contributions each value averages."""
    dropped_senders: dict[str, str] = field(default_factory=dict)
    """As a reducer: senders it stopped waiting for, and why."""
    failed_reducers: dict[str, str] = field(default_factory=dict)
    """As a sender: reducers whose part it did not fully get back, and why."""
    bytes_sent: int = 0
    """Data-plane bytes this member put on the wire (frames, headers and tags included)."""
    bytes_received: int = 0

    @property
    def complete(self) -> bool:
        return not self.dropped_senders and not self.failed_reducers


@dataclass(frozen=True)
class Handoff:
    """An accepted connection passed to its round; the round sets `released` when done with
    it (trio closes a served stream when its handler returns, so the handler waits)."""

    sender: str
    stream: trio.SocketStream
    hello: bytes
    released: trio.Event = field(default_factory=trio.Event)


class DataServer:
    """Accepts data-plane connections and hands each to the round it belongs to."""

    def __init__(self, *, hello_timeout: float = 5.0) -> None:
        self.hello_timeout = hello_timeout
        self._rounds: dict[bytes, tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel]] = {}
        # A fast member may connect before we have opened the round: it waits a little.
        self._opening: dict[bytes, trio.Event] = {}
        self._early = 0
        self._early_per_round: dict[bytes, int] = {}

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on (host, port); reports the bound port to `nursery.start`."""
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, host=host), self._handle, port
            )
            task_status.started(listeners[0].socket.getsockname()[1])

    def open_inbox(self, round_id: bytes) -> trio.MemoryReceiveChannel[Handoff]:
        send, receive = trio.open_memory_channel[Handoff](math.inf)
        self._rounds[round_id] = (send, receive)
        opened = self._opening.pop(round_id, None)
        if opened is not None:
            opened.set()
        return receive

    def close_inbox(self, round_id: bytes) -> None:
        """The round is over: release what it never took."""
        channels = self._rounds.pop(round_id, None)
        if channels is None:
            return
        send, receive = channels
        send.close()
        while True:
            try:
                receive.receive_nowait().released.set()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            with trio.fail_after(self.hello_timeout):
                frame = await receive_frame(stream, max_bytes=MAX_HELLO_BYTES)
            hello = msgspec.msgpack.decode(bytes(frame or b""), type=Hello)
        except (trio.TooSlowError, *DECODE_ERRORS, *CONNECTION_ERRORS):
            await stream.aclose()
            return
        channels = self._rounds.get(hello.round_id)
        rid = hello.round_id
        if (
            channels is None
            and self._early < MAX_EARLY_CONNECTIONS
            and self._early_per_round.get(rid, 0) < MAX_EARLY_PER_ROUND
        ):
            self._early += 1
            self._early_per_round[rid] = self._early_per_round.get(rid, 0) + 1
            opened = self._opening.setdefault(rid, trio.Event())
            try:
                with trio.move_on_after(self.hello_timeout):
                    await opened.wait()
            finally:
                self._early -= 1
                self._early_per_round[rid] -= 1
                if not self._early_per_round[rid]:
                    del self._early_per_round[rid]
                if not opened.is_set():  # a round that never opened leaves nothing behind
                    self._opening.pop(rid, None)
            channels = self._rounds.get(hello.round_id)
        if channels is None:
            await stream.aclose()  # not a round we take part in (or it is over)
            return
        handoff = Handoff(hello.sender, stream, bytes(frame))
        channels[0].send_nowait(handoff)
        await handoff.released.wait()


async def allreduce(
    spec: RoundSpec,
    round_key: RoundKey,
    vector: np.ndarray,
    server: DataServer,
    *,
    deadline: float,
    stall_timeout: float,
    norm_factor: float | None = None,
) -> RoundReport:
    """Average `vector` (float32, flat, updated in place) with the group; see the module doc.

    `deadline` is a `trio.current_time()` value; `stall_timeout` bounds each wait for a peer.
    With a `norm_factor` the part this member reduces is averaged robustly
    (`peer.averaging.robust`): the choice is each reducer's own, not the group's.
    """
    me = round_key.peer_id
    index = next(i for i, m in enumerate(spec.members) if m.peer_id == me)
    inbox = server.open_inbox(spec.round_id)
    try:
        round_ = _Round(spec, index, round_key, vector, stall_timeout, norm_factor)
        return await round_.run(inbox, deadline)
    finally:
        server.close_inbox(spec.round_id)


class _Round:
    def __init__(
        self,
        spec: RoundSpec,
        index: int,
        round_key: RoundKey,
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
        self.round_key = round_key
        self.vector = vector
        self.stall_timeout = stall_timeout
        self.norm_factor = norm_factor
        self.codec = CODECS[spec.codec]
        self.parts = spec.parts()
        self.report = RoundReport(chunks=[])
        self.assembler = (
            ResultAssembler(vector, self.parts, chunk_elements=spec.chunk_elements)
            if self.me.computes
            else None
        )
        self.keys: dict[tuple[str, bool], ConnectionKeys] = {}  # (other, we dial) -> keys
        self.part: _PartService | None = None
        self.channels: list[SealedChannel] = []

    def _derive_keys(self) -> dict[str, str]:
        """Connection keys with every other member, both ways; returns the members whose
        signed round key does not check out (nobody can talk to them this round)."""
        unusable = {}
        for other in self.spec.members:
            if other.peer_id != self.me.peer_id:
                try:
                    for we_dial in (True, False):
                        self.keys[(other.peer_id, we_dial)] = self.round_key.connection_keys(
                            other.key, we_dial=we_dial
                        )
                except BadPart as error:
                    unusable[other.peer_id] = str(error)
        return unusable

    async def run(self, inbox: trio.MemoryReceiveChannel, deadline: float) -> RoundReport:
        lo, hi = self.parts[self.index]
        if self.me.computes and not np.isfinite(self.vector).all():
            raise ValueError("the local vector holds NaN or Inf: it cannot be averaged")
        unusable = self._derive_keys()
        with trio.move_on_at(deadline):
            async with trio.open_nursery() as nursery:
                if hi > lo:
                    self.part = _PartService(self)
                    for peer_id, reason in unusable.items():
                        if peer_id in self.part.remote:
                            self.part.drop(peer_id, reason)
                    nursery.start_soon(self.part.run, inbox)
                if self.me.computes:
                    for j, member in enumerate(self.spec.members):
                        start, end = self.parts[j]
                        if j == self.index or end == start:
                            continue
                        if member.peer_id in unusable:
                            self.report.failed_reducers[member.peer_id] = unusable[member.peer_id]
                        else:
                            nursery.start_soon(self._send_to, j, member)
        for j, member in enumerate(self.spec.members):
            if self._owes_me(j):
                self.report.failed_reducers.setdefault(member.peer_id, "the deadline passed")
        if self.part is not None:
            for sender in self.part.reducer.waiting_for():
                self.report.dropped_senders.setdefault(sender, "the deadline passed")
        if self.assembler is not None:
            self.report.chunks = self.assembler.report()
        self.report.bytes_sent += sum(c.bytes_sent for c in self.channels)
        self.report.bytes_received += sum(c.bytes_received for c in self.channels)
        return self.report

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
            keys = self.keys[(reducer.peer_id, True)]
            with trio.fail_after(self.stall_timeout):
                stream = await trio.open_tcp_stream(reducer.host, reducer.port)
            async with stream:
                hello = msgspec.msgpack.encode(Hello(self.spec.round_id, self.me.peer_id))
                await send_frame(stream, hello)
                with trio.fail_after(self.stall_timeout):
                    challenge = await receive_frame(stream, max_bytes=CHALLENGE_BYTES)
                if challenge is None or len(challenge) != CHALLENGE_BYTES:
                    raise BadPart("the reducer sent no challenge")
                channel = SealedChannel(
                    stream, send_key=keys.contributions, receive_key=keys.averages
                )
                self.channels.append(channel)
                self.report.bytes_sent += 4 + len(hello)
                self.report.bytes_received += 4 + CHALLENGE_BYTES
                await channel.send(DONE, 0, hello + challenge)  # it is us, on this connection
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._send_chunks, channel, j)
                    await self._receive_averages(channel, j)
        except* (trio.TooSlowError, *CONNECTION_ERRORS) as group:
            error = _first(group)
            self.report.failed_reducers[reducer.peer_id] = _reason(error)
            log.debug("reducer %s failed: %r", reducer.peer_id, error)

    async def _send_chunks(self, channel: SealedChannel, j: int) -> None:
        start, end = self.parts[j]
        for index, (lo, hi) in enumerate(chunk_ranges(start, end, self.spec.chunk_elements)):
            await channel.send(index, 0, self.codec.encode(self.vector[lo:hi]))
        await channel.send(DONE, 0, b"")

    async def _receive_averages(self, channel: SealedChannel, j: int) -> None:
        assert self.assembler is not None
        max_payload = self.codec.wire_bytes(self.spec.chunk_elements)
        while not self.assembler.part_complete(j):
            # An average waits for the part's slowest sender, whom the reducer gives up on
            # after its own stall timeout (checked every quarter of it): allow for that too.
            with trio.fail_after(2.5 * self.stall_timeout):
                frame = await channel.receive(max_payload=max_payload)
            if frame is None:
                raise BadPart("the reducer closed the connection before its part was complete")
            index, senders, payload = frame
            if index == DONE:
                raise BadPart("the reducer ended its part early")
            chunks = self.assembler.chunks[j]
            if not 0 <= index < len(chunks):
                raise BadPart(f"chunk {index} is out of range")
            lo, hi = chunks[index]
            self.assembler.put(j, index, self.codec.decode(payload, hi - lo), senders)
        # Read the end marker too: hanging up before it would reset the reducer's last send.
        # The part is complete either way, so a failure here is no failure of the reducer.
        with trio.move_on_after(self.stall_timeout), suppress(*CONNECTION_ERRORS):
            await channel.receive(max_payload=0)


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
        self.outboxes: dict[str, trio.MemorySendChannel] = {}
        self.all_averaged = trio.Event()  # every chunk averaged (or given up)
        self.idle = trio.Event()  # no connection is being served (renewed when one starts)
        self.idle.set()
        self.active = 0
        self.authenticating: dict[str, int] = {}  # unauthenticated connections per claimed sender
        self.progressed = trio.Event()  # set (and renewed) whenever contributions were added

    async def run(self, inbox: trio.MemoryReceiveChannel) -> None:
        round_, reducer = self.round, self.reducer
        if round_.me.computes:  # our own contribution, from memory but through the codec
            codec = round_.codec  # as if sent: then every group adds the same bits for it
            for index, (a, b) in enumerate(reducer.chunks):
                own = codec.decode(codec.encode(round_.vector[self.lo + a : self.lo + b]), b - a)
                reducer.add(round_.me.peer_id, index, own)
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._accept, inbox, nursery)
            self.publish()
            while not reducer.done:  # a watchdog for senders that never connect
                with trio.move_on_after(round_.stall_timeout / 4):
                    await self.all_averaged.wait()
                if trio.current_time() - started >= round_.stall_timeout:
                    for peer_id in set(reducer.waiting_for()) - self.connected:
                        self.drop(peer_id, f"did not connect within {round_.stall_timeout:.3g}s")
                self.publish()
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
                or self.authenticating.get(sender, 0) >= MAX_PENDING_PER_SENDER
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
        """Average every chunk that just became complete and queue it for every sender."""
        round_ = self.round
        for index in self.reducer.take_complete():
            average, count = self.reducer.average(index)
            if average is None or not np.isfinite(average).all():
                continue  # nobody delivered it, or the sum overflowed: members keep local values
            payload = round_.codec.encode(average)
            if round_.assembler is not None:  # the decoded bytes: what everyone else gets
                decoded = round_.codec.decode(payload, len(average))
                round_.assembler.put(round_.index, index, decoded, count)
            for outbox in self.outboxes.values():
                outbox.send_nowait((index, count, payload))
        if self.reducer.done:
            for sender in list(self.outboxes):
                self._close_outbox(sender)
            self.all_averaged.set()
        self.progressed.set()
        self.progressed = trio.Event()

    async def _serve(self, handoff: Handoff) -> None:
        sender, stream = handoff.sender, handoff.stream
        try:
            async with stream:
                channel = await self._authenticate(handoff)
                if channel is None or sender in self.connected or sender in self.reducer.dropped:
                    return  # a stranger's bytes never count against the member it names
                self.connected.add(sender)
                outbox, outgoing = trio.open_memory_channel(math.inf)
                self.outboxes[sender] = outbox
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_forward, channel, outgoing)
                        await self._take_chunks(channel, sender)
                except* (trio.TooSlowError, *CONNECTION_ERRORS) as group:
                    error = _first(group)
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

    async def _authenticate(self, handoff: Handoff) -> SealedChannel | None:
        """The connection's channel if its first sealed frame proves the hello and our fresh
        challenge (so a recorded greeting cannot be replayed); else None."""
        sender = handoff.sender
        keys = self.round.keys[(sender, False)]
        channel = SealedChannel(
            handoff.stream, send_key=keys.averages, receive_key=keys.contributions
        )
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        self.authenticating[sender] = self.authenticating.get(sender, 0) + 1
        try:
            await send_frame(handoff.stream, challenge)
            with trio.fail_after(self.round.stall_timeout):
                first = await channel.receive(max_payload=MAX_HELLO_BYTES + CHALLENGE_BYTES)
        except (trio.TooSlowError, *CONNECTION_ERRORS) as error:
            log.debug("unauthenticated connection claiming %s: %r", sender, error)
            return None
        finally:
            self.authenticating[sender] -= 1
        if first is None or first[2] != handoff.hello + challenge:
            return None
        self.round.channels.append(channel)  # counted in the report from here on
        return channel

    async def _take_chunks(self, channel: SealedChannel, sender: str) -> None:
        round_, reducer = self.round, self.reducer
        max_payload = round_.codec.wire_bytes(round_.spec.chunk_elements)
        while True:
            # Far ahead of a sender added before it: read on once those chunks were added (the
            # first sender in order is never held back, so this cannot deadlock).
            while reducer.queued[sender] >= MAX_QUEUED_CHUNKS:
                await self.progressed.wait()
            with trio.fail_after(round_.stall_timeout):
                frame = await channel.receive(max_payload=max_payload)
            if frame is None:
                raise BadPart("the sender disconnected before its last chunk")
            index, _, payload = frame
            if index == DONE:
                if sender in reducer.waiting_for():
                    raise BadPart("the sender ended before sending every chunk")
                return
            if not 0 <= index < len(reducer.chunks):
                raise BadPart(f"chunk {index} is out of range")
            reducer.add(sender, index, round_.codec.decode(payload, reducer.chunk_size(index)))
            self.publish()


async def _forward(channel: SealedChannel, outgoing: trio.MemoryReceiveChannel) -> None:
    """Send the averages queued for one sender, then the end marker."""
    async for index, count, payload in outgoing:
        await channel.send(index, count, payload)
    await channel.send(DONE, 0, b"")


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first leaf of a (nested) exception group: the error that ended a connection."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _reason(error: BaseException) -> str:
    if isinstance(error, trio.TooSlowError):
        return "stalled"
    return str(error) or type(error).__name__
