"""The DHT over real libp2p on loopback: 16 server nodes in one process, a hand-moved clock."""

from __future__ import annotations

import dataclasses
import time

import trio
from libp2p.peer.id import ID

from peer.config import DhtConfig
from peer.dht import protocol as dht
from peer.dht.node import REJOIN_ATTEMPTS
from peer.dht.records import Entry, make_entry
from peer.errors import RpcError, Unreachable
from tests.helpers import FakeClock, swarm

CONFIG = dataclasses.replace(
    DhtConfig(), replicas=5, bucket_size=20, alpha=3, purge_interval=3600.0
)
N = 16


async def test_store_get_subkeys_and_latest_wins_across_nodes():
    clock = FakeClock()
    async with swarm(N, CONFIG, clock=clock) as s:
        now = clock.now
        assert await s.dhts[3].store("k", "a", b"one", expiration=now + 60) >= CONFIG.replicas - 1
        await s.dhts[5].store("k", "b", b"two", expiration=now + 60)
        got = await s.dhts[12].get("k")
        assert {sub: e.value for sub, e in got.items()} == {"a": b"one", "b": b"two"}
        # An older write loses against the newer one, whoever writes it and wherever it is read.
        await s.dhts[7].store("k", "a", b"stale", expiration=now + 30)
        assert (await s.dhts[9].get("k"))["a"].value == b"one"
        await s.dhts[7].store("k", "a", b"newer", expiration=now + 90)
        for reader in (0, 4, 15):
            assert (await s.dhts[reader].get("k"))["a"].value == b"newer"
        assert await s.dhts[1].get("missing") == {}


async def test_expired_entries_are_never_returned():
    clock = FakeClock()
    async with swarm(N, CONFIG, clock=clock) as s:
        await s.dhts[2].store("k", "a", b"short", expiration=clock.now + 10)
        await s.dhts[2].store("k", "b", b"long", expiration=clock.now + 100)
        clock.now += 11
        got = await s.dhts[8].get("k")
        assert set(got) == {"b"}
        purged = sum(d.records.purge(now=clock.now) for d in s.dhts)
        assert purged == 0  # get already dropped the expired copies on every replica it asked


async def test_a_slow_read_keeps_what_the_replicas_held_live_when_it_began():
    """A lookup slower than a record's remaining TTL must not drop the record it was given."""
    clock = FakeClock()
    async with swarm(N, CONFIG, clock=clock) as s:
        await s.dhts[2].store("k", "a", b"v", expiration=clock.now + 4)
        reader = s.dhts[8]
        calls = 0

        def slow_clock() -> float:  # every reading after the first is 5 s later
            nonlocal calls
            calls += 1
            return clock.now + (0 if calls == 1 else 5)

        reader.clock = slow_clock
        assert set(await reader.get("k")) == {"a"}
        reader.clock = lambda: clock.now + 5  # a read that begins after the expiry
        assert await reader.get("k") == {}


async def test_update_is_visible_to_every_reader_and_withdraw_hides_it():
    clock = FakeClock()
    async with swarm(N, CONFIG, clock=clock) as s:
        writer = s.dhts[6]
        own = writer.node.peer_id.to_base58()
        for version in range(5):
            clock.now += 1
            await writer.store("presence", own, f"v{version}".encode(), expiration=clock.now + 30)
            for reader in s.dhts[::5]:
                assert (await reader.get("presence"))[own].value == f"v{version}".encode()
        await writer.withdraw("presence", own, expiration=clock.now + 31)
        assert own not in await s.dhts[11].get("presence")


async def test_forged_owner_entries_are_rejected_by_every_node():
    clock = FakeClock()
    async with swarm(N, CONFIG, clock=clock) as s:
        victim, mallory = s.dhts[4], s.dhts[9]
        subkey = victim.node.peer_id.to_base58()
        await victim.store("presence", subkey, b"genuine", expiration=clock.now + 30)
        forged = make_entry(
            "presence",
            subkey,
            b"forged",
            clock.now + 60,
            signer=mallory.node.identity.key_pair.private_key,
        )
        assert await mallory.store_entries("presence", {subkey: forged}) == 0
        unsigned = Entry(b"forged", clock.now + 60)
        assert await mallory.store_entries("presence", {subkey: unsigned}) == 0
        assert (await s.dhts[0].get("presence"))[subkey].value == b"genuine"
        # A malicious replica that serves a forged entry anyway is not believed by readers.
        for dht in s.dhts:
            dht.records._records.setdefault("presence", {})[subkey] = forged
        reader = s.dhts[14]
        reader.records._records.clear()
        assert subkey not in await reader.get("presence")


async def test_values_survive_a_quarter_of_nodes_dying():
    clock = FakeClock()
    async with swarm(N, CONFIG, clock=clock) as s:
        keys = [f"key-{i}" for i in range(12)]
        for i, key in enumerate(keys):
            assert await s.dhts[i % N].store(key, "x", key.encode(), expiration=clock.now + 600) > 0
        for index in (1, 5, 10, 13):
            s.kill(index)
        survivors = [d for i, d in enumerate(s.dhts) if i not in (1, 5, 10, 13)]
        for i, key in enumerate(keys):
            got = await survivors[i % len(survivors)].get(key)
            assert got["x"].value == key.encode(), key


async def test_clock_skew_of_a_few_seconds_does_not_break_records():
    clock = FakeClock()
    offsets = [(-4.0 if i % 2 else 4.0) for i in range(N)]
    async with swarm(N, CONFIG, clock=clock, offsets=offsets) as s:
        ahead, behind = s.dhts[0], s.dhts[1]  # 8 s apart
        for writer, reader in ((ahead, behind), (behind, ahead)):
            own = writer.node.peer_id.to_base58()
            for version in range(3):
                clock.now += 1
                await writer.store("presence", own, b"%d" % version, expiration=writer.clock() + 30)
                assert (await reader.get("presence"))[own].value == b"%d" % version


async def test_a_flooding_writer_is_refused_and_the_others_still_store():
    """Resource limits (issue 7): each caller's record bytes per window are budgeted."""
    config = dataclasses.replace(CONFIG, caller_store_bytes=64 * 1024, store_window=600.0)
    async with swarm(3, config) as s:
        target, flooder, honest = s.dhts
        big = b"x" * 8000
        stored, refusal = 0, None
        for i in range(100):  # 800 kB: far beyond the 64 KiB budget
            request = dht.Store(f"flood/{i}", {"s": Entry(big, time.time() + 60)})
            try:
                await flooder.node.rpc.call(
                    target.node.peer_id, dht.SERVICE, "store", request, dht.StoreReply, timeout=5
                )
                stored += 1
            except RpcError as error:
                refusal = error
                break
        assert refusal is not None and refusal.code == "unavailable"
        assert "store budget spent" in str(refusal)
        assert 1 <= stored <= 64 * 1024 // 8000
        request = dht.Store("honest", {"s": Entry(b"hello", time.time() + 60)})
        reply = await honest.node.rpc.call(
            target.node.peer_id, dht.SERVICE, "store", request, dht.StoreReply, timeout=5
        )
        assert reply.verdicts == {"s": "stored"}


async def test_a_call_that_times_out_closes_the_connection_so_the_next_one_dials_afresh():
    """Over a cut (a partition, a blackhole) a py-libp2p connection stays open with no
    keepalive, and TCP's retransmission backoff kept calls over it dead for ~30 s after the
    testbed's partition healed: the peers cut off stepped alone meanwhile."""
    from peer.net.rpc import protocol_id

    async with swarm(2, CONFIG) as s:
        caller, silent = s.dhts
        silent.node.host.set_stream_handler(protocol_id(dht.SERVICE), hang)
        caller.node.rpc.forget(silent.node.peer_id)  # no pooled stream: the next call opens one
        caller.rpc_timeout = 0.5
        network = caller.node.host.get_network()
        (before,) = network.connections[silent.node.peer_id]  # bootstrapped through it
        with trio.fail_after(10):
            assert await caller.get("k") == {}  # asks its only contact, which never answers
        assert caller._calls["get", "timeout"] == 1, caller._calls
        assert before not in network.connections.get(silent.node.peer_id, [])


async def hang(stream) -> None:
    await trio.sleep_forever()


async def test_a_node_that_dropped_every_contact_joins_again_through_them():
    """A burst of failed calls (py-libp2p closing a connection under several streams) can drop
    every contact at once; such a node read only itself from then on, and a trainer on it
    called steps alone forever while the others trained on (1 run in ~15 of a 3-peer test).
    It joins again through the contacts it dropped, within `REJOIN_INTERVAL`, with no
    backbone configured and a purge interval of an hour."""
    async with swarm(3, CONFIG) as s:
        lonely = s.dhts[2]
        others = {d.node.peer_id for d in s.dhts[:2]}
        assert {c.peer_id for c in lonely.table.contacts()} == others
        for contact in lonely.table.contacts():
            lonely._forget(contact, Unreachable("connection closed"))
        assert len(lonely.table) == 0
        with trio.fail_after(20):
            while {c.peer_id for c in lonely.table.contacts()} != others:
                await trio.sleep(0.1)
        now = time.time()
        await s.dhts[0].store("k", "a", b"one", expiration=now + 60)
        assert (await lonely.get("k"))["a"].value == b"one"


async def test_a_dropped_contact_that_never_answers_is_tried_a_few_times_then_given_up():
    """A dropped contact's addresses are its own claim: an isolated node tries them
    `REJOIN_ATTEMPTS` times, not every 2 s for as long as it stays alone."""
    async with swarm(2, CONFIG) as s:
        lonely = s.dhts[0]
        s.kill(1)
        (gone,) = lonely.table.contacts()
        lonely._forget(gone, Unreachable("connection closed"))
        tried: list[list[ID]] = []
        bootstrap = lonely.bootstrap

        async def counting(seeds):
            tried.append([peer_id for peer_id, _ in seeds])
            return await bootstrap(seeds)

        lonely.bootstrap = counting  # type: ignore[method-assign]
        with trio.fail_after(60):
            while lonely._forgotten:
                await trio.sleep(0.1)
        assert tried == [[gone.peer_id]] * REJOIN_ATTEMPTS
        assert lonely._rejoin_candidates() == []  # nothing left to dial
