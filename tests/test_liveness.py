"""Liveness: a peer that sees no other participant joins the DHT again, catches up and trains.

Pure: when the policy finds itself out of touch (`StepPolicy.out_of_touch`). In process: a
node that gave up every contact joins again through peers it knew (`DHT.rejoin`). The real
processes (`peer join`, SIGKILL in the middle of an all-reduce) are in
`tests/test_liveness_processes.py` (slow)."""

from __future__ import annotations

import time

import trio

from peer.averaging.averager import AveragingResult
from peer.errors import Unreachable
from peer.training.policy import LONE_READS
from tests.helpers import swarm
from tests.test_dht import CONFIG
from tests.test_policy import T0, make_policy, other, read


def test_a_peer_that_reads_nobody_else_for_a_while_is_out_of_touch():
    policy = make_policy()
    after = policy.timing.rejoin_after
    read(policy, other("a"), now=T0)
    assert not policy.out_of_touch(T0 + after - 0.1)
    read(policy, now=T0 + 1)  # a read showing only ourselves
    assert not policy.out_of_touch(T0 + after - 0.1)
    assert policy.out_of_touch(T0 + after)
    policy.rejoined(T0 + after)  # the next bound counts from the rejoin
    assert not policy.out_of_touch(T0 + 2 * after - 0.1)
    assert policy.out_of_touch(T0 + 2 * after)
    read(policy, other("a"), now=T0 + 2 * after)  # back in touch
    assert not policy.out_of_touch(T0 + 2 * after + 1)


def test_averagings_that_read_no_other_ticket_while_others_train_put_us_out_of_touch():
    """The survivor of issue 45 read no other ticket 24-193 times in a row while the records
    showed the others: after `LONE_READS` such averagings it joins again."""
    policy = make_policy()
    read(policy, other("a"), now=T0)
    for n in range(LONE_READS):
        assert not policy.out_of_touch(T0 + n)
        policy.declare(T0 + n, T0 + n, in_background=False)
        policy.averaged(AveragingResult(peers_seen=1), 8, T0 + n, T0 + n)
    assert policy.out_of_touch(T0 + LONE_READS)
    policy.rejoined(T0 + LONE_READS)
    assert not policy.out_of_touch(T0 + LONE_READS)
    # Alone in the records too, reading only our own ticket is no sign of trouble.
    lone = make_policy()
    read(lone, now=T0)
    for n in range(LONE_READS):
        lone.declare(T0 + n, T0 + n, in_background=False)
        lone.averaged(AveragingResult(peers_seen=1), 8, T0 + n, T0 + n)
    assert not lone.out_of_touch(T0 + LONE_READS)


async def test_a_node_that_gave_up_every_contact_joins_again_through_peers_it_knew():
    """Every contact dropped and each given up after its attempts (they did not answer while
    the node tried: its own link was down), no backbone configured: the node read only itself
    for good. `rejoin` with the peers its trainer read records of brings the others back."""
    async with swarm(3, CONFIG) as s:
        lonely = s.dhts[2]
        others = {d.node.peer_id: d.node.announce[0] for d in s.dhts[:2]}
        for contact in lonely.table.contacts():
            lonely._forget(contact, Unreachable("connection closed"))
        lonely._forgotten.clear()  # given up
        for dht in s.dhts[:2]:  # and they dropped it (a partition, both ways)
            dht._forget(dht.table.get(lonely.node.peer_id), Unreachable("connection closed"))
        assert len(lonely.table) == 0 and lonely._rejoin_candidates() == []
        now = time.time()
        await s.dhts[0].store("k", "a", b"one", expiration=now + 60)
        assert "a" not in await lonely.get("k")  # reads only itself
        with trio.fail_after(20):
            reached = await lonely.rejoin(list(others.items()))
        assert set(reached) == set(others)
        assert {c.peer_id for c in lonely.table.contacts()} == set(others)
        assert (await lonely.get("k"))["a"].value == b"one"
