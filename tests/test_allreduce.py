"""Butterfly all-reduce over the real data plane (TLS 1.3 on loopback TCP), in process.

Honest members run `allreduce`; misbehaving ones are small test doubles speaking the wire
protocol through the public helpers (`dial_reducer`, `wire.Channel`): a sender that stalls,
dies, sends NaN or the wrong size; one that claims to be another member; a reducer that says
nothing or dies half-way.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import threading
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pytest
import trio

from peer.averaging import allreduce as allreduce_module
from peer.averaging.allreduce import (
    DataServer,
    Member,
    RoundReport,
    RoundSpec,
    allreduce,
    check_spec,
    dial_reducer,
)
from peer.averaging.compression import CODECS, Codec
from peer.averaging.partition import chunk_ranges
from peer.averaging.wire import DONE, Channel, include_mask, mask_bytes
from peer.errors import ProtocolError
from peer.net.identity import Identity
from tests.helpers import data_identity, needs_ipv6, new_identity

ROUND = b"test-round"
SIZE = 10_007  # not a multiple of anything: uneven parts and a short last chunk
CHUNK = 1024
TOLERANCE = {"none": 1e-5, "fp16": 1e-2, "int8": 8e-2}
STALL = 2.0  # the honest members' stall timeout (1 s cut 2M-float rounds short under load)
HOLD = 6.0  # how long a misbehaving double keeps its connections: past every honest timeout


@dataclass
class Player:
    """One member: its identity, data server (with its TLS certificate), role and vector."""

    identity: Identity
    server: DataServer
    port: int
    computes: bool
    share: float
    weight: float
    vector: np.ndarray
    host: str = "127.0.0.1"

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id.to_base58()

    def member(self) -> Member:
        return Member(
            peer_id=self.peer_id,
            host=self.host,
            port=self.port,
            computes=self.computes,
            share=self.share,
            weight=self.weight,
            cert=self.server.identity.certificate,
        )


ROLES = {  # computes, share
    "normal": (True, 1.0),
    "client": (True, 0.0),  # client-only: cannot be dialed, reduces nothing
    "aggregator": (False, 1.0),  # a backbone: reduces, contributes nothing
}

Behaviour = Callable[[Player, RoundSpec], Awaitable[RoundReport | None]]
B = TypeVar("B", bound=Behaviour)


FAULTY: set[Behaviour] = set()


def faulty(behave: B) -> B:
    """Marks a misbehaving double: the round is over for it once every other member is done
    (`run_group` cancels it there, rather than wait out the HOLD s it keeps connections)."""
    FAULTY.add(behave)
    return behave


async def honest(player: Player, spec: RoundSpec) -> RoundReport:
    return await allreduce(
        spec, player.vector, player.server, deadline=trio.current_time() + 30, stall_timeout=STALL
    )


async def run_group(
    roles: list[str],
    *,
    codec: str = "none",
    behaviours: dict[int, Behaviour] | None = None,
    seed: int = 0,
    size: int = SIZE,
    tweak: Callable[[list[np.ndarray]], None] = lambda vectors: None,
    host: str = "127.0.0.1",
) -> tuple[list[Player], list[np.ndarray], list[RoundReport | None]]:
    """Run one round; returns players (sorted as in the spec), original vectors, reports.
    `tweak` may change the members' vectors before the round; `host`: where they listen."""
    rng = np.random.default_rng(seed)
    identities = sorted((new_identity() for _ in roles), key=lambda i: i.peer_id.to_base58())
    behaviours = behaviours or {}
    async with trio.open_nursery() as nursery:
        players = []
        for identity, role in zip(identities, roles, strict=True):
            computes, share = ROLES[role]
            server = DataServer(data_identity(identity))
            port = await nursery.start(server.serve, host, 0)
            vector = rng.standard_normal(size).astype(np.float32) * 3
            weight = float(rng.integers(1, 5)) if computes else 0.0
            players.append(Player(identity, server, port, computes, share, weight, vector, host))
        tweak([p.vector for p in players])
        originals = [p.vector.copy() for p in players]
        members = [p.member() for p in players]
        spec = RoundSpec(
            round_id=ROUND,
            members=tuple(members),
            size=size,
            codec=codec,
            chunk_elements=CHUNK,
        )
        reports: list[RoundReport | None] = [None] * len(players)

        doubles = {i for i, behave in behaviours.items() if behave in FAULTY}
        waiting = len(players) - len(doubles)
        others_done = trio.Event()

        async def play(i: int) -> None:
            nonlocal waiting
            reports[i] = await behaviours.get(i, honest)(players[i], spec)
            if i not in doubles:
                waiting -= 1
                if waiting == 0:
                    others_done.set()

        with trio.fail_after(60):
            async with trio.open_nursery() as members:
                for i in range(len(players)):
                    members.start_soon(play, i)
                if doubles and waiting:
                    await others_done.wait()
                    members.cancel_scope.cancel()  # the doubles' round is over
        nursery.cancel_scope.cancel()
    return players, originals, reports


def spec_of(players: list[Player]) -> RoundSpec:
    members = tuple(p.member() for p in players)
    return RoundSpec(round_id=ROUND, members=members, size=SIZE, codec="none", chunk_elements=CHUNK)


def weighted_average(players: list[Player], originals: list[np.ndarray], among) -> np.ndarray:
    chosen = [
        (p.weight, o.astype(np.float64))
        for p, o in zip(players, originals, strict=True)
        if among(p)
    ]
    return sum(w * o for w, o in chosen) / sum(w for w, _ in chosen)


def mixes(n: int) -> list[list[str]]:
    """All normal; one client-only; one aggregator-only; one of each (where n allows)."""
    out = [["normal"] * n, ["client"] + ["normal"] * (n - 1), ["aggregator"] + ["normal"] * (n - 1)]
    if n >= 3:
        out.append(["client", "aggregator"] + ["normal"] * (n - 2))
    if n >= 4:
        out.append(["client", "client", "aggregator", "aggregator"] + ["normal"] * (n - 4))
    return out


CASES = [(n, roles) for n in (2, 3, 4, 5, 8) for roles in mixes(n)]


@pytest.mark.parametrize(
    ("n", "roles"),
    CASES,
    ids=[f"{n}-{'+'.join(sorted(set(r)))}-{i}" for i, (n, r) in enumerate(CASES)],
)
async def test_exact_weighted_average_for_every_mix_of_roles(n, roles):
    players, originals, reports = await run_group(roles, seed=n)
    expected = weighted_average(players, originals, lambda p: p.computes)
    computing = [i for i, p in enumerate(players) if p.computes]
    everyone = {players[i].peer_id for i in computing}
    for i in computing:
        np.testing.assert_allclose(players[i].vector, expected, atol=TOLERANCE["none"])
        assert reports[i].complete
        assert {c.senders for c in reports[i].chunks} == {len(computing)}
        assert reports[i].exact_over == everyone and not reports[i].undelivered
        assert reports[i].seconds > 0  # the round's own time, logged with each step
    for i in computing[1:]:
        assert np.array_equal(players[i].vector, players[computing[0]].vector)
    # Wire bytes follow the role solver's model: P (c + g (K - 2c)) each way, plus framing.
    parts = [hi - lo for lo, hi in RoundSpec.parts(spec_of(players))]
    k = len(computing)
    for i, p in enumerate(players):
        c = 1 if p.computes else 0
        model = 4 * (c * (SIZE - parts[i]) + parts[i] * (k - c))
        assert model <= reports[i].bytes_sent <= model * 1.02 + 2000
        assert model <= reports[i].bytes_received <= model * 1.02 + 2000
    for i, p in enumerate(players):
        if not p.computes:  # an aggregator keeps its own (zero-weight, unused) vector
            assert np.array_equal(p.vector, originals[i]) and reports[i].chunks == []


@needs_ipv6
async def test_members_on_ipv6_addresses_average_exactly():
    players, originals, reports = await run_group(["normal", "normal", "aggregator"], host="::1")
    expected = weighted_average(players, originals, lambda p: p.computes)
    for i, p in enumerate(players):
        if p.computes:
            np.testing.assert_allclose(p.vector, expected, atol=TOLERANCE["none"])
            assert reports[i].complete and reports[i].reducer_paths  # type: ignore[union-attr]


@pytest.mark.parametrize("codec", ["fp16", "int8"])
async def test_compressed_rounds_stay_within_the_codec_error_and_agree(codec):
    roles = ["normal", "client", "aggregator", "normal"]
    players, originals, _ = await run_group(roles, codec=codec)
    expected = weighted_average(players, originals, lambda p: p.computes)
    computing = [p for p in players if p.computes]
    for p in computing:
        np.testing.assert_allclose(p.vector, expected, atol=TOLERANCE[codec])
        assert np.array_equal(p.vector, computing[0].vector)  # every member got the same bytes


# ---------------------------------------------------------------------------- misbehaving senders


def faulty_sender(mode: str) -> Behaviour:
    """A client-only member that sends its part contributions with a fault."""

    @faulty
    async def behave(player: Player, spec: RoundSpec) -> None:
        if mode == "absent":  # dies before sending anything
            return
        parts = spec.parts()
        async with trio.open_nursery() as nursery:
            for j, reducer in enumerate(spec.members):
                if parts[j][1] > parts[j][0]:
                    nursery.start_soon(send_faultily, player, spec, reducer, parts[j], mode)

    return behave


async def send_faultily(player: Player, spec: RoundSpec, reducer: Member, part, mode: str) -> None:
    codec = CODECS[spec.codec]
    player.server.identity.trust([reducer.cert])
    with (
        trio.move_on_after(HOLD),
        contextlib.suppress(ProtocolError, OSError, trio.BrokenResourceError),
    ):
        while True:  # as an honest sender does: dial until the reducer has opened the round
            try:
                stream = await dial_reducer(player.server, spec.round_id, reducer)
                break
            except (ProtocolError, OSError):
                await trio.sleep(0.01)
        async with stream:
            channel = Channel(stream)
            chunks = chunk_ranges(*part, spec.chunk_elements)
            for index, (lo, hi) in enumerate(chunks):
                values = player.vector[lo:hi].copy()
                if mode == "nan" and index == 0:
                    values[3] = np.nan
                if mode == "wrong size" and index == 0:
                    values = values[:-1]
                if mode == "out of order" and index < 2:  # chunk 1 first
                    index = 1 - index
                    values = player.vector[slice(*chunks[index])].copy()
                if mode in ("stall", "die") and index >= len(chunks) // 2:
                    if mode == "stall":
                        await trio.sleep(HOLD)
                    else:  # once the chunks it sent are averaged: then they hold it for sure
                        await receive_averages(channel, spec, index)
                    return  # closes the connection mid-part
                await channel.send(index, 0, codec.encode(values))
            await channel.send(DONE, 0, b"")
            await trio.sleep(HOLD)  # keep the connection open; the reducer decides


async def receive_averages(channel: Channel, spec: RoundSpec, count: int) -> None:
    """Read `count` averages from a reducer (whatever they hold)."""
    computing = sum(m.computes for m in spec.members)
    limit = mask_bytes(computing) + CODECS[spec.codec].wire_bytes(spec.chunk_elements)
    for _ in range(count):
        assert await channel.receive(max_payload=limit) is not None


@pytest.mark.parametrize("mode", ["absent", "nan", "wrong size", "out of order", "stall", "die"])
async def test_a_misbehaving_sender_is_dropped_and_the_rest_agree(mode):
    roles = ["normal", "normal", "normal", "client"]
    players, originals, reports = await run_group(
        roles, behaviours={3: faulty_sender(mode)}, seed=7
    )
    bad = players[3].peer_id
    honest_ids = range(3)
    for i in honest_ids:
        assert reports[i].dropped_senders.get(bad), (mode, reports[i].dropped_senders)
        if mode == "out of order":
            assert "came where chunk 0 was due" in reports[i].dropped_senders[bad]
    for i in honest_ids[1:]:
        assert np.array_equal(players[i].vector, players[0].vector)
    without = weighted_average(players, originals, lambda p: p.computes and p.peer_id != bad)
    with_bad = weighted_average(players, originals, lambda p: p.computes)
    counts = {}
    for chunk in reports[0].chunks:
        counts[chunk.start] = chunk.senders
        values = players[0].vector[chunk.start : chunk.end]
        if mode in ("absent", "nan", "wrong size", "out of order"):  # never averaged in
            assert chunk.senders == 3
            np.testing.assert_allclose(values, without[chunk.start : chunk.end], atol=1e-5)
        elif chunk.senders == 4:  # delivered before it stalled or died
            np.testing.assert_allclose(values, with_bad[chunk.start : chunk.end], atol=1e-5)
        else:
            assert chunk.senders == 3
            np.testing.assert_allclose(values, without[chunk.start : chunk.end], atol=1e-5)
    if mode in ("stall", "die"):
        assert set(counts.values()) == {3, 4}  # half of every part with it, half without


# ---------------------------------------------------------------------------- misbehaving reducers


def faulty_reducer(mode: str) -> Behaviour:
    """An aggregator-only member that takes contributions and then fails its part."""

    @faulty
    async def behave(player: Player, spec: RoundSpec) -> None:
        computing = {m.peer_id: m.cert for m in spec.members if m.computes}
        inbox = player.server.open_inbox(spec.round_id, computing)
        part = spec.parts()[[m.peer_id for m in spec.members].index(player.peer_id)]
        chunks = chunk_ranges(*part, spec.chunk_elements)
        codec = CODECS[spec.codec]
        senders = [m for m in spec.members if m.computes]
        with trio.move_on_after(HOLD):
            async with trio.open_nursery() as nursery:
                for _ in senders:
                    handoff = await inbox.receive()
                    nursery.start_soon(serve, handoff, player, spec, chunks, codec, mode)
        player.server.close_inbox(spec.round_id)

    return behave


async def serve(handoff, player, spec, chunks, codec, mode) -> None:
    channel = Channel(handoff.stream)
    try:
        for _ in itertools.count():
            frame = await channel.receive(max_payload=codec.wire_bytes(spec.chunk_elements))
            if frame is None or frame[0] == DONE:
                break
        if mode == "dies half-way":  # sends back its own values for half the part, then dies
            computing = [m.peer_id for m in spec.members if m.computes]
            mask = include_mask(computing, computing)  # claiming everyone's contribution
            for index, (lo, hi) in enumerate(chunks[: len(chunks) // 2]):
                values = codec.encode(player.vector[lo:hi])
                await channel.send(index, len(computing), values, prefix=mask)
            return
        await trio.sleep(HOLD)  # "silent": takes everything, answers nothing
    finally:
        await handoff.stream.aclose()
        handoff.released.set()


@pytest.mark.parametrize("mode", ["silent", "dies half-way"])
async def test_a_failing_reducer_leaves_local_values_and_the_rest_agree(mode):
    roles = ["normal", "normal", "aggregator", "normal"]
    players, originals, reports = await run_group(roles, behaviours={2: faulty_reducer(mode)})
    bad = players[2].peer_id
    bad_part = reports[0].chunks  # find the reducer's part from the spec's cut
    bad_lo, bad_hi = spec_of(players).parts()[2]
    honest_ids = [0, 1, 3]
    expected = weighted_average(players, originals, lambda p: p.computes)
    for i in honest_ids:
        assert bad in reports[i].failed_reducers
        assert not reports[i].dropped_senders
        assert reports[i].exact_over is None  # a part is missing
        for chunk in reports[i].chunks:
            values = players[i].vector[chunk.start : chunk.end]
            if chunk.senders == 0:  # the failed part: this member's own values
                assert np.array_equal(values, originals[i][chunk.start : chunk.end])
            elif bad_lo <= chunk.start < bad_hi:  # what the dying reducer sent back, as is
                assert np.array_equal(values, originals[2][chunk.start : chunk.end])
            else:
                assert chunk.senders == 3
                np.testing.assert_allclose(values, expected[chunk.start : chunk.end], atol=1e-5)
    kept_local = {c.start for c in bad_part if c.senders == 0}
    assert kept_local  # the failed part was reported
    if mode == "dies half-way":  # its first averages (a valid mask) were taken
        assert any(c.senders and bad_lo <= c.start < bad_hi for c in bad_part)
    completed = [c for c in reports[0].chunks if c.senders > 0]
    for i in honest_ids[1:]:  # identical wherever a value was averaged
        for c in completed:
            assert np.array_equal(
                players[i].vector[c.start : c.end], players[0].vector[c.start : c.end]
            )


async def test_a_round_never_outlives_its_deadline():
    async def impatient(player: Player, spec: RoundSpec) -> RoundReport:
        return await allreduce(
            spec, player.vector, player.server, deadline=trio.current_time() + 0.5,
            stall_timeout=30.0,
        )  # fmt: skip

    roles = ["normal", "normal", "aggregator"]
    # The silent reducer holds its connections for HOLD s; the members' stall timeout is 30 s,
    # so only the 0.5 s deadline can end their round before this bound.
    with trio.fail_after(HOLD + 10):
        players, _, reports = await run_group(
            roles, behaviours={0: impatient, 1: impatient, 2: faulty_reducer("silent")}
        )
    for i in (0, 1):
        assert reports[i].failed_reducers.get(players[2].peer_id) == "the deadline passed"


async def test_a_spec_listing_a_member_with_another_peers_certificate_is_refused():
    """A leader that substitutes its own certificate for a member's (to read that member's
    contribution and forge its averages) is caught before anyone dials."""
    identities = [new_identity() for _ in range(3)]
    certs = [data_identity(i).certificate for i in identities]
    names = [i.peer_id.to_base58() for i in identities]

    def spec(listed: list[bytes]) -> RoundSpec:
        members = tuple(
            Member(peer_id=n, host="127.0.0.1", port=9000 + k, computes=True, share=1.0,
                   weight=1.0, cert=c)
            for k, (n, c) in enumerate(zip(names, listed, strict=True))
        )  # fmt: skip
        return RoundSpec(round_id=ROUND, members=members, size=SIZE, codec="none",
                         chunk_elements=CHUNK)  # fmt: skip

    check_spec(spec(certs), names[1])  # the honest spec passes
    with pytest.raises(ProtocolError, match="another peer's"):
        check_spec(spec([certs[0], certs[0], certs[2]]), names[2])  # member 1 gets 0's cert
    with pytest.raises(ProtocolError, match="does not check out"):
        check_spec(spec([certs[0], b"\x30" * 40, certs[2]]), names[2])


async def test_a_connection_claiming_another_member_is_refused_and_the_round_completes():
    """A member dials a reducer with its own certificate but names another member in its
    hello: the reducer hangs up, and the member it named still delivers its contribution."""

    async def impostor_then_honest(player: Player, spec: RoundSpec) -> RoundReport:
        target, victim = spec.members[0], spec.members[1]
        player.server.identity.trust([target.cert])
        posing = copy.copy(player.server)  # same certificate, another name in the hello
        posing.identity = copy.copy(player.server.identity)
        posing.identity.peer_id = victim.peer_id
        await trio.sleep(0.2)  # the reducer has opened the round by now
        with pytest.raises(ProtocolError, match="hung up"):
            await dial_reducer(posing, spec.round_id, target)
        return await honest(player, spec)

    players, originals, reports = await run_group(
        ["normal", "normal", "normal"], behaviours={2: impostor_then_honest}
    )
    expected = weighted_average(players, originals, lambda p: True)
    for i in range(3):
        assert reports[i].complete, reports[i]
        np.testing.assert_allclose(players[i].vector, expected, atol=1e-5)


async def test_a_stray_connection_does_not_cut_a_reducer_short():
    """A connection that sends junk and ends before the real senders arrive must not make
    the reducer think its last averages have left."""
    size = 2_000_000

    async def stray_then_honest(player: Player, spec: RoundSpec) -> RoundReport:
        target = spec.members[0]
        with contextlib.suppress(trio.BrokenResourceError, OSError):
            async with await trio.open_tcp_stream(target.host, target.port) as stream:
                await stream.send_all(b"\x16\x03\x01 not a TLS hello" * 10)
        await trio.sleep(0.2)
        return await honest(player, spec)

    players, originals, reports = await run_group(
        ["normal", "normal", "normal"], behaviours={2: stray_then_honest}, size=size
    )
    expected = weighted_average(players, originals, lambda p: True)
    for i in range(3):
        assert reports[i].complete, reports[i]
        np.testing.assert_allclose(players[i].vector, expected, atol=1e-5)
        assert np.array_equal(players[i].vector, players[0].vector)


class RecordingCodec:
    """A test double: `inner`'s encoding, noting the thread of every call, and the memory it
    decodes into: the buffers it is given (each counted once), and how many arrays it
    allocated itself are alive at once."""

    transforms = True

    def __init__(self, inner: Codec) -> None:
        self.inner = inner
        self.name = f"recording-{inner.name}"
        self.threads: set[int] = set()
        self.live = self.most_live = 0
        self.buffers: dict[int, np.ndarray] = {}  # held: an id is not reused meanwhile
        self.lock = threading.Lock()

    def wire_bytes(self, count: int) -> int:
        return self.inner.wire_bytes(count)

    def encode(self, values: np.ndarray, *, out=None) -> memoryview:
        self.threads.add(threading.get_ident())
        return self.inner.encode(values) if out is None else self.inner.encode(values, out=out)

    def decode(self, data, count: int, *, out: np.ndarray | None = None) -> np.ndarray:
        self.threads.add(threading.get_ident())
        if out is not None:
            buffer = out if out.base is None else out.base
            self.buffers[id(buffer)] = buffer
            return self.inner.decode(data, count, out=out)
        values = self.inner.decode(data, count)  # memory of its own: counted while alive
        with self.lock:
            self.live += 1
            self.most_live = max(self.most_live, self.live)
        weakref.finalize(values, self._freed)
        return values

    def _freed(self) -> None:
        with self.lock:
            self.live -= 1


@pytest.mark.parametrize("inner", ["fp16", "int8"])
async def test_codec_work_runs_off_the_event_loop_and_streams_chunk_by_chunk(inner, monkeypatch):
    """Every encode and decode (and so every sum: a reducer encodes each average right after
    adding it up, in the same call) runs in a worker thread, never on the trio thread; and a
    round decodes into a few chunk buffers per connection and sender, not into a new array per
    chunk with its own part decoded in full up front (three parts of 326 chunks: that held 980
    at once)."""
    recording = RecordingCodec(CODECS[inner])
    monkeypatch.setitem(CODECS, recording.name, recording)
    size, members = 1_000_000, 3
    players, originals, reports = await run_group(
        ["normal"] * members, codec=recording.name, size=size
    )
    assert recording.threads and threading.get_ident() not in recording.threads
    part_chunks = -(-size // members // CHUNK)
    decoded_at_once = recording.most_live + len(recording.buffers)
    assert decoded_at_once < part_chunks, (recording.most_live, len(recording.buffers))
    expected = weighted_average(players, originals, lambda p: True)
    for i, player in enumerate(players):
        assert reports[i].complete, reports[i]
        # int8: half a step of the largest value in each block of 1024, twice (a million
        # normal values times 3 reach 15: steps of 0.12).
        np.testing.assert_allclose(
            player.vector, expected, atol={"fp16": 1e-2, "int8": 0.15}[inner]
        )
        assert np.array_equal(player.vector, players[0].vector)


async def test_float32_max_values_are_averaged_finite_and_exact_for_everyone():
    """A member sends float32-max values in its first chunk beside honest ones: the float32 sum
    overflowed and that chunk was kept local by everyone, nobody dropped. The sums are float64
    now: every chunk is averaged over everyone, bit for bit the float64 mean (added in spec
    order, as `weighted_average` adds them), and nobody is dropped."""

    def huge(vectors):
        vectors[1][:CHUNK] = np.finfo(np.float32).max  # finite, but a float32 sum is not
        vectors[2][: CHUNK // 2] = -np.finfo(np.float32).max

    players, originals, reports = await run_group(["normal"] * 3, tweak=huge, seed=4)
    expected = weighted_average(players, originals, lambda p: True).astype(np.float32)
    assert np.isfinite(expected).all() and np.abs(expected[:CHUNK]).max() > 1e37
    for i in range(3):
        assert reports[i].complete, reports[i]
        assert {c.senders for c in reports[i].chunks} == {3}
        assert players[i].vector.tobytes() == expected.tobytes()


async def test_a_reducer_whose_own_values_decode_to_inf_drops_itself_not_the_chunk():
    """int8 decodes a block of float32-max values to inf. A remote sender's such chunk is
    refused and the sender dropped; the reducer's own, passed through the codec as it adds it,
    made the sum inf and the chunk was kept local by everyone. Now the reducer leaves itself
    out of that chunk and drops itself from its part: the others' average stands."""

    def huge(vectors):
        vectors[0][:CHUNK] = np.finfo(np.float32).max  # member 0 reduces part 0: chunk 0

    players, originals, reports = await run_group(["normal"] * 3, codec="int8", tweak=huge)
    me = players[0].peer_id
    assert me in reports[0].dropped_senders and "not finite" in reports[0].dropped_senders[me]
    others = {players[1].peer_id, players[2].peer_id}
    expected = weighted_average(players, originals, lambda p: p.peer_id in others)
    for i in range(3):
        first = reports[i].chunks[0]
        assert (first.start, first.end) == (0, CHUNK) and first.included == others
        assert all(c.senders for c in reports[i].chunks)  # no chunk kept local
        np.testing.assert_allclose(players[i].vector[:CHUNK], expected[:CHUNK], atol=0.1)
        assert np.array_equal(players[i].vector[:CHUNK], players[0].vector[:CHUNK])


async def test_hellos_racing_the_end_of_their_round_never_end_the_server():
    """A member keeps dialing a reducer as its rounds open and close (an honest member still
    retrying does so too): a hello answered just as its round closed made the data server's
    task fail, and with it the daemon."""
    reducer = DataServer(data_identity(new_identity()))
    member = DataServer(data_identity(new_identity()))
    member.identity.trust([reducer.identity.certificate])
    rng = np.random.default_rng(1)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(reducer.serve, "127.0.0.1", 0)
            target = Member(
                peer_id=reducer.identity.peer_id, host="127.0.0.1", port=port, computes=True,
                share=1.0, weight=1.0, cert=reducer.identity.certificate,
            )  # fmt: skip
            accepted = 0

            async def hammer(round_id: bytes) -> None:
                nonlocal accepted
                while True:
                    with contextlib.suppress(ProtocolError, OSError, trio.BrokenResourceError):
                        stream = await dial_reducer(member, round_id, target)
                        accepted += 1
                        await stream.aclose()
                    await trio.sleep(0)

            async def drain(inbox) -> None:
                async for handoff in inbox:
                    handoff.released.set()

            for number in range(40):
                round_id = b"round-%d" % number
                inbox = reducer.open_inbox(
                    round_id, {member.identity.peer_id: member.identity.certificate}
                )
                async with trio.open_nursery() as hammers:
                    for _ in range(6):
                        hammers.start_soon(hammer, round_id)
                    hammers.start_soon(drain, inbox)
                    await trio.sleep(float(rng.uniform(0.002, 0.03)))
                    reducer.close_inbox(round_id)
                    await trio.sleep(0.005)
                    hammers.cancel_scope.cancel()
            assert accepted > 0
            nursery.cancel_scope.cancel()


async def test_no_buffer_of_a_finished_round_outlives_it(monkeypatch):
    """A round's sums outlived it in reference cycles (its tasks' frames) until a full garbage
    collection: at 100 M parameters, 0.8-1.7 GB of finished rounds were alive at any time.
    With the collector off, every reducer's sum is freed once the round has returned."""
    sums: list[weakref.ref] = []

    class Recorded(allreduce_module.PartReducer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            sums.append(weakref.ref(self.sum))

    monkeypatch.setattr(allreduce_module, "PartReducer", Recorded)
    gc.collect()
    gc.disable()
    try:
        await run_group(["normal", "normal", "client"], seed=3)
        alive = [ref for ref in sums if ref() is not None]
    finally:
        gc.enable()
    assert len(sums) == 2 and not alive
