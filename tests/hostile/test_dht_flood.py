"""Flooders write junk under a training collaboration's progress and presence keys through the
DHT API (issue 16, classes 6 and 8): the global step keeps advancing at half the calm rate or
more, while they flood and after, and no honest process exits.

Before the bounded DHT (peer.dht.records), each of 6 throw-away identities wrote 40 open subkeys
of 60 KiB under each key on every replica, which kept them as long as asked (up to a day);
every get reply grew past the 4 MiB message limit, so readers saw neither key, dropped every
replica from their routing table, and `peer status` saw no step at all."""

from __future__ import annotations

import contextlib
import time

import pytest
import trio
from libp2p.crypto.keys import PrivateKey

from peer.config import DhtConfig
from peer.dht.node import DHT
from peer.dht.records import Entry, make_entry
from peer.errors import RemoteError
from peer.net.host import open_node, split_peer_addr
from peer.net.identity import ephemeral_identity
from peer.presence import presence_key
from peer.training.progress import progress_key
from tests.collab_processes import Collaboration
from tests.hostile.common import ENV

KEYS = (progress_key("default"), presence_key("default"))
IDENTITIES = 6
OPEN_SUBKEYS = 40  # per key and identity: what the old limits let through in a few seconds
JUNK = b"j" * (60 * 1024)
TTL = 3000.0  # as long as the new limit allows; the old one allowed a day
CALM = ATTACK = AFTER = 10.0  # seconds: calm, flooding, and after it (the junk stays)


def junk(key: str, me: str, signer: PrivateKey) -> tuple[dict[str, Entry], list[tuple]]:
    """Our own (signed) junk entry under `key`, and `OPEN_SUBKEYS` open ones."""
    expiration = time.time() + TTL
    opened = [
        (s, make_entry(key, s, JUNK, expiration, signer=None))
        for s in (f"junk-{me[-6:]}-{i}" for i in range(OPEN_SUBKEYS))
    ]
    return {me: make_entry(key, me, JUNK, expiration, signer=signer)}, opened


async def flood(backbone_addr: str, *, seconds: float) -> int:
    """`IDENTITIES` client-mode DHT nodes store all the junk they can under `KEYS` for
    `seconds`: open subkeys in batches of 12 (which the old limits took whole), one by one
    once a batch is refused, and their own subkey. Returns how many stores some replica kept."""
    seed = split_peer_addr(backbone_addr, what="backbone")
    kept = 0

    async def one() -> None:
        nonlocal kept
        identity = ephemeral_identity()
        async with open_node(identity, listen=[], announce=[], max_message_bytes=4 << 20) as node:
            dht = DHT(node, DhtConfig(), server=False, rpc_timeout=5.0)
            me = node.peer_id.to_base58()
            batch = 12
            while True:
                for key in KEYS:
                    if len(dht.table) == 0:  # a refused store drops the contacts that refused it
                        await dht.bootstrap([seed])
                    own, opened = junk(key, me, identity.key_pair.private_key)
                    for entries in [
                        own,
                        *(dict(opened[b : b + batch]) for b in range(0, OPEN_SUBKEYS, batch)),
                    ]:
                        with contextlib.suppress(RemoteError):
                            stored = await dht.store_entries(key, entries)
                            kept += stored > 0
                            if not stored and len(entries) > 1:
                                batch = 1  # refused whole: one by one from the next round
                                break
                await trio.sleep(0.5)

    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            for _ in range(IDENTITIES):
                nursery.start_soon(one)
    return kept


def step_at(steps: list[int]) -> tuple[float, int]:
    return time.monotonic(), steps[-1] if steps else -1


@pytest.mark.slow  # 40-80 s of real processes: CI keeps to 15 minutes (run with -m slow)
def test_junk_under_the_progress_and_presence_keys_does_not_stop_training(tmp_path):
    collab = Collaboration(tmp_path, ENV)
    try:
        collab.start_backbone()
        peers = [collab.start_peer(i) for i in range(2)]
        collab.watch_global_step()
        steps = collab.global_steps
        deadline = time.monotonic() + 90
        while not (steps and steps[-1] >= 2):
            assert all(p.popen.poll() is None for p in collab.procs), "a process exited"
            assert time.monotonic() < deadline, "the collaboration never reached step 2"
            time.sleep(0.2)

        calm_start = step_at(steps)
        time.sleep(CALM)
        calm_end = step_at(steps)
        kept = trio.run(lambda: flood(collab.backbone_addr, seconds=ATTACK))
        time.sleep(AFTER)
        attack_end = step_at(steps)

        assert kept > 0  # the flooders did store junk
        exited = [
            (p.name, p.log.read_text()[-2000:]) for p in collab.procs if p.popen.poll() is not None
        ]
        assert not exited, exited
        calm_rate = (calm_end[1] - calm_start[1]) / (calm_end[0] - calm_start[0])
        attack_rate = (attack_end[1] - calm_end[1]) / (attack_end[0] - calm_end[0])
        assert calm_rate > 0, steps
        assert attack_rate >= 0.5 * calm_rate, (calm_rate, attack_rate, steps[-40:])
        assert all(p.popen.poll() is None for p in peers)
    finally:
        collab.close()
