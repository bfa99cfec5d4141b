"""Link probes against a backbone: upload and download bytes/s and round-trip time.

Protocol `/peertrain/probe/1`, one probe per stream, control messages as frames
(`peer.net.framing`), bulk data as raw bytes:

    ping:      Ping ->  Pong{server_time} (up to 32 on one stream; the client keeps the fastest;
               the backbone's wall clock lets `peer doctor` estimate clock skew)
    download:  Probe{download, n} ->  Accepted{n', seconds} | Refused, then n' raw bytes, EOF;
               Measured{bytes, seconds} ->
    upload:    Probe{upload, n}   ->  Accepted{n', seconds} | Refused;  n' raw bytes, EOF
                                  ->  Measured{bytes, seconds, attestation}

The receiving side measures and tells the other: the client for downloads, the backbone for
uploads. So a backbone learns its own capacity from the probes it serves (`capacity()`: the
best rates of the last hour), without trusting a number anyone typed in; a caller's download
report is capped by how fast the backbone saw its bytes leave. A rate is
taken over the last three quarters of the bytes (`measured_window`), so TCP slow start and the
first round trip do not count. A backbone grants at most `max_bytes` per probe and stops after
`max_seconds`; each caller has a byte budget that refills over `budget_window` seconds
(`ByteBudgets`), and at most `max_concurrent` probes run at once, one per caller, so nobody
can use a backbone to flood links or take every slot. A refusal says when to retry.

What a backbone measured of a caller it signs (`peer.measure.attestation`): the upload's
`Measured` reply carries an `Attestation` of that upload and of the caller's latest download
report (within `ATTEST_WINDOW`), signed with the backbone's libp2p identity key. Others use
those figures for averaging shares and deadlines, never the caller's own. The field is optional
both ways (msgspec ignores unknown fields), so older peers and backbones still interoperate.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
import trio
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import PrivateKey
from libp2p.peer.id import ID
from libp2p.protocol_muxer.exceptions import MultiselectClientError

from peer.config import ProbeConfig
from peer.errors import (
    DECODE_ERRORS,
    DeadlineExceeded,
    NotABackbone,
    ProtocolError,
    RemoteError,
    Unreachable,
)
from peer.measure.attestation import Attestation, attest, signed
from peer.net.host import Node
from peer.net.ratelimit import ByteBudgets
from peer.net.rpc import READ_CHUNK, TRANSPORT_ERRORS, FramedStream

log = logging.getLogger("peertrain.probe")

PROTOCOL = "/peertrain/probe/1"
MAX_CONTROL_BYTES = 1024
CONTROL_TIMEOUT = 10.0
MAX_PINGS = 32  # per stream; then the stream ends
MAX_PROBE_SECONDS = 60.0  # the longest transfer a client agrees to
CAPACITY_WINDOW = 3600.0
# Seconds a caller's download report counts toward its attestation: measure_link probes the
# download just before the upload, so one measuring round fits easily.
ATTEST_WINDOW = 300.0
MAX_REPORTS = 1024  # callers whose latest download report a backbone keeps
_ZEROS = bytes(READ_CHUNK)


class Ping(msgspec.Struct, tag=True):
    pass


class Pong(msgspec.Struct, tag=True):
    server_time: Annotated[float, msgspec.Meta(ge=0, le=1e11)] | None = None
    """The backbone's wall clock (unix seconds) when it answered; None from older backbones
    (the default keeps their bare `Pong` decodable, and older clients ignore the field)."""


class Probe(msgspec.Struct, tag=True):
    direction: Literal["upload", "download"]
    bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]


# A reply that breaks these bounds fails to decode: a hostile backbone cannot make a client
# wait forever or advertise a negative rate.
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_PROBE_SECONDS)]
ByteCount = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]


class Accepted(msgspec.Struct, tag=True):
    bytes: ByteCount
    seconds: Annotated[float, msgspec.Meta(gt=0, le=MAX_PROBE_SECONDS)]


class Refused(msgspec.Struct, tag=True):
    reason: Annotated[str, msgspec.Meta(max_length=200)]
    retry_after: Annotated[float, msgspec.Meta(ge=0, le=86400)]


class Measured(msgspec.Struct, tag=True):
    bytes: ByteCount
    seconds: Seconds
    attestation: Attestation | None = None
    """An upload's: the backbone's signed figures of the caller (None in download reports,
    and from older backbones)."""


_requests = msgspec.msgpack.Decoder(Ping | Probe)
_replies = msgspec.msgpack.Decoder(Pong | Accepted | Refused | Measured)
_encode = msgspec.msgpack.Encoder().encode


@dataclass(frozen=True)
class PingSample:
    rtt_s: float
    """Round trip, on the monotonic clock."""
    sent: float
    """Our wall clock when the ping left, and when the reply came."""
    received: float
    server_time: float | None
    """The backbone's wall clock in its reply (None from older backbones)."""


@dataclass(frozen=True)
class LinkMeasurement:
    upload_bps: float
    download_bps: float
    rtt_s: float
    attestation: Attestation | None = None
    """The backbone's signed figures of us (checked: ours, its signature), if it gave one."""


# ---------------------------------------------------------------------------- pure parts


def measured_window(samples: list[tuple[float, int]]) -> tuple[int, float]:
    """(bytes, seconds) of a transfer from (time, bytes so far) samples, leaving out the first
    quarter of the bytes, which carries TCP slow start and the request's round trip.

    With too few samples to leave it out, the whole transfer counts; (0, 0.0) if nothing moved.
    """
    if len(samples) < 2:
        return 0, 0.0
    total = samples[-1][1]
    start = next(s for s in samples if s[1] >= total / 4)
    if start is samples[-1]:
        start = samples[0]
    return total - start[1], samples[-1][0] - start[0]


def rate(window: tuple[int, float]) -> float:
    count, seconds = window
    return count / seconds if seconds > 0 else 0.0


# ---------------------------------------------------------------------------- backbone side


class ProbeServer:
    """Serves link probes on a backbone."""

    def __init__(
        self,
        host: IHost,
        limits: ProbeConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        key: PrivateKey | None = None,
    ) -> None:
        """`clock` paces budgets and rates; `wall_clock` is the time a `Pong` reports and an
        attestation states; `key` signs attestations (default: the host's identity key)."""
        self.limits = limits
        self.clock = clock
        self.wall_clock = wall_clock
        self.key = key if key is not None else host.get_private_key()
        self.signer = host.get_id().to_base58()
        # caller -> (clock, bytes/s) of its latest download report, capped by our send rate
        self._downloads: OrderedDict[ID, tuple[float, float]] = OrderedDict()
        self.budgets = ByteBudgets(capacity=limits.budget_bytes, window=limits.budget_window)
        self.running = 0
        self.probing: set[ID] = set()  # callers with a probe running
        self._rates: deque[tuple[float, str, float]] = deque(maxlen=256)  # (at, direction, bps)
        host.set_stream_handler(PROTOCOL, self._serve)

    def capacity(self, *, now: float, window: float = CAPACITY_WINDOW) -> tuple[float, float]:
        """(upload, download) bytes/s this backbone has shown in the probes of `window`
        seconds: the best rate it sent at and the best it received at (0 when none)."""
        best = {"download": 0.0, "upload": 0.0}
        for at, direction, bps in self._rates:
            if now - at <= window:
                best[direction] = max(best[direction], bps)
        # A caller's download is the backbone's upload, and the other way round.
        return best["download"], best["upload"]

    async def _serve(self, stream: INetStream) -> None:
        caller = stream.muxed_conn.peer_id
        framed = FramedStream(stream, MAX_CONTROL_BYTES)
        try:
            for _ in range(MAX_PINGS):
                frame = None  # stays None if the caller says nothing in time
                with trio.move_on_after(CONTROL_TIMEOUT):
                    frame = await framed.read_frame()
                if frame is None:
                    break
                request = _requests.decode(frame)
                if isinstance(request, Ping):
                    await framed.write_frame(_encode(Pong(self.wall_clock())))
                    continue
                await self._probe(caller, framed, request)
                break
        except (ProtocolError, *DECODE_ERRORS, *TRANSPORT_ERRORS) as error:
            log.debug("probe from %s ended: %r", caller, error)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                try:
                    await stream.close()
                except TRANSPORT_ERRORS:
                    await framed.reset()

    async def _probe(self, caller: ID, framed: FramedStream, request: Probe) -> None:
        if self.running >= self.limits.max_concurrent:
            await framed.write_frame(_encode(Refused("busy: too many probes at once", 1.0)))
            return
        if caller in self.probing:  # one at a time each: a greedy caller cannot take every slot
            await framed.write_frame(_encode(Refused("busy: your other probe is running", 1.0)))
            return
        granted = min(request.bytes, self.limits.max_bytes)
        wait = self.budgets.try_spend(caller, granted, now=self.clock())
        if wait > 0:
            reason = "rate limited: this caller's probe budget is spent"
            await framed.write_frame(_encode(Refused(reason, wait)))
            return
        self.running += 1
        self.probing.add(caller)
        try:
            await framed.write_frame(_encode(Accepted(granted, self.limits.max_seconds)))
            deadline = time.perf_counter() + self.limits.max_seconds
            if request.direction == "download":
                await self._serve_download(caller, framed, granted, deadline)
                return
            samples: list[tuple[float, int]] = []
            # The caller stops sending at the same deadline; the margin covers one round trip.
            with trio.move_on_after(self.limits.max_seconds + CONTROL_TIMEOUT):
                await receive_counted(framed, granted, samples, deadline=deadline + 1.0)
            window = measured_window(samples)
            attestation = self.attest(caller, rate(window))
            await framed.write_frame(_encode(Measured(*window, attestation)))
            self._rates.append((self.clock(), "upload", rate(window)))
        finally:
            self.running -= 1
            self.probing.discard(caller)

    def attest(self, caller: ID, upload_bps: float) -> Attestation:
        """Our signed figures of `caller`: the upload we just received, and its latest download
        report within ATTEST_WINDOW (0 without one: a verifier then counts its floor)."""
        now = self.clock()
        at, download = self._downloads.get(caller, (now, 0.0))
        return attest(
            self.key,
            signer=self.signer,
            subject=caller.to_base58(),
            upload_bps=upload_bps,
            download_bps=download if now - at <= ATTEST_WINDOW else 0.0,
            issued_at=self.wall_clock(),
        )

    async def _serve_download(
        self, caller: ID, framed: FramedStream, count: int, deadline: float
    ) -> None:
        start = time.perf_counter()
        sent = 0
        # The deadline is checked between writes; this bounds a write a slow reader stalls.
        with trio.move_on_after(self.limits.max_seconds + CONTROL_TIMEOUT) as scope:
            sent = await send_zeros(framed.stream, count, deadline=deadline)
            await framed.stream.close()
        if scope.cancelled_caught:
            return
        # Writes return once yamux buffered the bytes, so this overestimates: a cap only.
        send_rate = sent / max(time.perf_counter() - start, 1e-9)
        with trio.move_on_after(CONTROL_TIMEOUT):
            frame = await framed.read_frame()
            report = _replies.decode(frame) if frame is not None else None
            if isinstance(report, Measured):
                reported = min(rate((report.bytes, report.seconds)), send_rate)
                self._rates.append((self.clock(), "download", reported))
                self._downloads[caller] = (self.clock(), reported)
                self._downloads.move_to_end(caller)
                if len(self._downloads) > MAX_REPORTS:
                    self._downloads.popitem(last=False)


async def send_zeros(stream: INetStream, count: int, *, deadline: float) -> int:
    """Write `count` zero bytes, stopping early at `deadline` (checked between chunks, so
    no write is ever cancelled half-way). Returns the bytes written."""
    sent = 0
    while sent < count and time.perf_counter() < deadline:
        chunk = min(len(_ZEROS), count - sent)
        await stream.write(_ZEROS[:chunk])
        sent += chunk
    return sent


async def receive_counted(
    framed: FramedStream, limit: int, samples: list[tuple[float, int]], *, deadline: float
) -> None:
    """Read raw bytes until EOF, `limit` or `deadline`, appending (time, bytes so far) to
    `samples` after every read (the list stays usable if the caller cancels us)."""
    received = len(framed.decoder.take_leftover())
    samples.append((time.perf_counter(), received))
    while received < limit and time.perf_counter() < deadline:
        try:
            data = await framed.stream.read(READ_CHUNK)
        except EOFError:
            return
        if not data:
            return
        received += len(data)
        samples.append((time.perf_counter(), received))


# ---------------------------------------------------------------------------- peer side


async def measure_link(
    node: Node,
    backbone: ID,
    *,
    target_seconds: float = 2.0,
    max_bytes: int = 32 << 20,
    pings: int = 5,
) -> LinkMeasurement:
    """Measure RTT, download and upload against `backbone`.

    Each direction first moves 256 KiB to estimate the rate, then enough bytes for about
    `target_seconds` (at most `max_bytes`). Raises RemoteError subclasses on refusal or failure.
    """
    rtt = min(sample.rtt_s for sample in await ping(node, backbone, pings))
    rates = {}
    attestation = None
    # Download first: the upload's attestation carries the download we just reported.
    for direction in ("download", "upload"):
        estimate, _ = await _probe(node, backbone, direction, 256 << 10)
        size = int(min(max_bytes, max(256 << 10, estimate * target_seconds)))
        rates[direction], attestation = await _probe(node, backbone, direction, size)
    return LinkMeasurement(rates["upload"], rates["download"], rtt, attestation)


def checked_attestation(
    attestation: Attestation | None, *, subject: ID, signer: ID
) -> Attestation | None:
    """`attestation` if it is `signer`'s, over `subject`, and its signature holds; else None
    (a bad one is dropped, never carried: every reader would check it again)."""
    if attestation is None:
        return None
    if attestation.subject != subject.to_base58() or attestation.signer != signer.to_base58():
        log.debug("%s sent an attestation of another peer or signer; dropped", signer)
        return None
    if not signed(attestation):
        log.debug("%s sent an attestation whose signature does not check out; dropped", signer)
        return None
    return attestation


async def _open(node: Node, backbone: ID) -> FramedStream:
    try:
        stream = await node.host.new_stream(backbone, [PROTOCOL])
    except TRANSPORT_ERRORS as error:
        if refused_protocol(error):
            raise NotABackbone(
                f"{backbone} is a peer, not a backbone: it does not serve {PROTOCOL}"
            ) from error
        raise Unreachable(
            f"{backbone} does not serve {PROTOCOL} ({error}); is it a backbone (`backbone start`)?"
        ) from error
    return FramedStream(stream, MAX_CONTROL_BYTES)


def refused_protocol(error: BaseException | None) -> bool:
    """Whether opening a stream failed because the other side answered that it does not
    serve the protocol (multistream-select's "na" to every one we offered), not because it
    could not be reached: py-libp2p raises both as a `StreamFailure`, the cause tells."""
    for _ in range(8):  # a chain is short; a cycle must not hang us
        if error is None:
            return False
        if isinstance(error, MultiselectClientError) and str(error).startswith(
            "protocols not supported"
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


async def _reply(framed: FramedStream, backbone: ID) -> Pong | Accepted | Refused | Measured:
    with trio.move_on_after(CONTROL_TIMEOUT):
        frame = await framed.read_frame()
        if frame is None:
            raise ProtocolError(f"{backbone} closed the probe stream without a reply")
        try:
            return _replies.decode(frame)
        except DECODE_ERRORS as error:
            raise ProtocolError(f"{backbone} sent a malformed probe reply: {error}") from None
    raise DeadlineExceeded(f"{backbone} did not answer a probe within {CONTROL_TIMEOUT:.3g}s")


async def ping(node: Node, backbone: ID, count: int) -> list[PingSample]:
    """`count` pings on one probe stream: each round trip, and the wall clocks around it."""
    framed = await _open(node, backbone)
    samples = []
    try:
        for _ in range(count):
            sent, start = time.time(), time.perf_counter()
            await framed.write_frame(_encode(Ping()))
            reply = await _reply(framed, backbone)
            rtt, received = time.perf_counter() - start, time.time()
            if not isinstance(reply, Pong):
                raise ProtocolError(f"{backbone} answered a ping with something else")
            samples.append(PingSample(rtt, sent, received, reply.server_time))
        await framed.stream.close()
    except TRANSPORT_ERRORS as error:
        raise Unreachable(f"ping to {backbone} failed: {error!r}") from error
    finally:
        await framed.reset()
    return samples


async def _probe(
    node: Node, backbone: ID, direction: str, size: int
) -> tuple[float, Attestation | None]:
    """One probe: the rate measured, and for an upload the backbone's checked attestation."""
    framed = await _open(node, backbone)
    try:
        await framed.write_frame(_encode(Probe(direction, size)))  # type: ignore[arg-type]
        reply = await _reply(framed, backbone)
        if isinstance(reply, Refused):
            raise RemoteError(
                f"{backbone} refused the {direction} probe ({reply.reason}); "
                f"retry in {reply.retry_after:.0f}s"
            )
        if not isinstance(reply, Accepted):
            raise ProtocolError(f"{backbone} answered a probe with {type(reply).__name__}")
        if reply.bytes > size:
            raise ProtocolError(f"{backbone} granted {reply.bytes} bytes; {size} were asked for")
        deadline = time.perf_counter() + reply.seconds
        if direction == "download":
            samples: list[tuple[float, int]] = []
            with trio.move_on_after(reply.seconds + CONTROL_TIMEOUT):
                await receive_counted(framed, reply.bytes, samples, deadline=deadline + 1.0)
            window = measured_window(samples)
            await framed.write_frame(_encode(Measured(*window)))  # the backbone learns too
            await framed.stream.close()
            with trio.move_on_after(1.0):  # its close says it read the report: then reset
                await framed.read_frame()
            return rate(window), None
        with trio.move_on_after(reply.seconds + CONTROL_TIMEOUT) as scope:
            await send_zeros(framed.stream, reply.bytes, deadline=deadline)
            await framed.stream.close()
            measured = await _reply(framed, backbone)
        if scope.cancelled_caught:
            raise DeadlineExceeded(f"upload probe to {backbone} overran its time limit")
        if not isinstance(measured, Measured):
            raise ProtocolError(f"{backbone} answered an upload with {type(measured).__name__}")
        attestation = checked_attestation(
            measured.attestation, subject=node.peer_id, signer=backbone
        )
        return rate((measured.bytes, measured.seconds)), attestation
    except TRANSPORT_ERRORS as error:
        raise Unreachable(f"{direction} probe to {backbone} failed: {error!r}") from error
    finally:
        await framed.reset()
