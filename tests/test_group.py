"""What a group agrees on before a round (pure): specs from tickets, shares, timeouts."""

from __future__ import annotations

import random

import msgspec
import pytest

from peer.averaging.group import (
    Joined,
    Ticket,
    able_to_reduce,
    build_spec,
    placed,
    round_id_of,
    round_timeouts,
    view_digest,
)
from peer.averaging.moshpit import placement, plan
from peer.measure.attestation import Evidence, attest
from peer.measure.capabilities import Capabilities
from peer.roles import aggregators
from tests.helpers import data_identity, new_identity

BACKBONE = new_identity()
NOW = 1_700_000_000.0
#: What a leader configured with BACKBONE accepts at NOW.
EVIDENCE = Evidence(
    trusted=frozenset({BACKBONE.peer_id.to_base58()}), at=NOW, max_age=3600.0, floor=1e6
)


def caps(
    bw: float, *, reachable: bool = True, punchable: bool = False, speed: float = 10.0,
    attestations=(),
):  # fmt: skip
    return Capabilities(
        samples_per_s=speed, upload_bps=bw, download_bps=bw, rtt_s=0.01, reachable=reachable,
        device="cpu", free_memory_bytes=1, measured_at=0.0, task="tiny", gradient_bytes=4,
        target_batch=32, attestations=tuple(attestations), punchable=punchable,
    )  # fmt: skip


def attested(subject: str, bw: float, *, signer=BACKBONE, issued_at: float = NOW - 60):
    """`signer`'s signed measurement of `subject`: bw both ways."""
    return attest(
        signer.key_pair.private_key, signer=signer.peer_id.to_base58(), subject=subject,
        upload_bps=bw, download_bps=bw, issued_at=issued_at,
    )  # fmt: skip


def joined(capabilities=None, *, weight: float = 1.0, measured: float | None = None) -> Joined:
    """A member; `measured`: BACKBONE attests that bandwidth (its ticket claims `capabilities`,
    or that bandwidth if none is given)."""
    identity = new_identity()
    peer_id = identity.peer_id.to_base58()
    if measured is not None:
        capabilities = capabilities or caps(measured)
        capabilities = msgspec.structs.replace(
            capabilities, attestations=(attested(peer_id, measured),)
        )
    ticket = Ticket(
        peer_id=peer_id, rpc_addrs=[], data_host="127.0.0.1", data_port=4000,
        computes=weight > 0, weight=weight, capabilities=capabilities,
    )  # fmt: skip
    return Joined(ticket, data_identity(identity).certificate)


def spec_of(members, size=1000, leader=None, evidence=EVIDENCE):
    leader = leader or min(j.ticket.peer_id for j in members)
    return build_spec(members, epoch=3, round_index=1, leader=leader,
                      size=size, codec="none", chunk_elements=100, evidence=evidence)  # fmt: skip


def test_spec_sorts_members_and_names_exactly_this_group():
    members = [joined() for _ in range(3)]
    spec = spec_of(members)
    assert [m.peer_id for m in spec.members] == sorted(j.ticket.peer_id for j in members)
    assert spec.round_id == spec_of(list(reversed(members))).round_id  # order does not matter
    assert spec.round_id != spec_of(members[:2]).round_id
    ids = [j.ticket.peer_id for j in members]
    assert round_id_of(3, 1, ids[0], ids) != round_id_of(3, 2, ids[0], ids)


def test_shares_come_from_the_solver_over_what_the_backbones_measured():
    fast, slow = joined(measured=1e8), joined(measured=2e7)
    hidden = joined(caps(1e7, reachable=False), measured=1e7)
    shares = {m.peer_id: m.share for m in spec_of([fast, slow, hidden]).members}
    assert shares[hidden.ticket.peer_id] == 0.0  # client-only: reduces nothing
    assert shares[fast.ticket.peer_id] > shares[slow.ticket.peer_id] > 0
    assert shares[fast.ticket.peer_id] <= 0.75  # capped: 1.5 / 2 reducers
    assert sum(shares.values()) == pytest.approx(1.0)


def test_without_measurements_shares_are_equal_among_the_reachable():
    known_hidden = joined(caps(1e7, reachable=False))
    members = [joined(), joined(), known_hidden]
    shares = {m.peer_id: m.share for m in spec_of(members).members}
    assert shares[known_hidden.ticket.peer_id] == 0.0
    assert sorted(shares.values()) == [0.0, 0.5, 0.5]


def test_peers_behind_nat_reduce_by_hole_punching_only_where_every_member_reaches_them():
    """A peer reachable by hole punching holds a share when every member of the group is
    reachable or punchable; with a client-only member (a symmetric NAT) in the group, none of
    them does. Nothing listens at such a member's data address: the spec gives it port 0."""
    punch = [joined(caps(1e7, reachable=False, punchable=True), measured=1e7) for _ in range(2)]
    public = joined(measured=1e7)
    hidden = joined(caps(1e7, reachable=False), measured=1e7)
    punch_ids = {j.ticket.peer_id for j in punch}

    shares = {m.peer_id: m.share for m in spec_of([*punch, public]).members}
    assert all(shares[p] > 0 for p in punch_ids), shares
    assert sum(shares.values()) == pytest.approx(1.0)
    ports = {m.peer_id: m.port for m in spec_of([*punch, public]).members}
    assert ports == {**dict.fromkeys(punch_ids, 0), public.ticket.peer_id: 4000}

    shares = {m.peer_id: m.share for m in spec_of([*punch, public, hidden]).members}
    assert shares == {**dict.fromkeys(punch_ids, 0.0), hidden.ticket.peer_id: 0.0,
                      public.ticket.peer_id: 1.0}  # fmt: skip
    # Only peers behind NAT, all punchable: they reduce for each other.
    assert all(m.share == pytest.approx(0.5) for m in spec_of(punch).members)
    # The leader's view of a member's DHT ticket counts too (it may say more than its join).
    bare = joined(caps(1e7, reachable=False), measured=1e7)
    declared = {bare.ticket.peer_id: msgspec.structs.replace(
        bare.ticket, capabilities=caps(1e7, reachable=False, punchable=True))}  # fmt: skip
    assert able_to_reduce([bare.ticket, punch[0].ticket]) == [False, False]
    assert able_to_reduce([bare.ticket, punch[0].ticket], declared) == [True, True]
    assert able_to_reduce([None, punch[0].ticket]) == [False, False]  # not in our view


def test_aggregators_need_every_peer_to_reach_a_punchable_one():
    assert aggregators([True, False, False], [False, True, True]) == [True, True, True]
    assert aggregators([True, False, False], [False, True, False]) == [True, False, False]
    assert aggregators([False, False], [True, True]) == [True, True]
    assert aggregators([True, True], [True, False]) == [True, True]  # reachable wins
    assert aggregators([], []) == []
    with pytest.raises(ValueError):
        aggregators([True], [])


def test_a_member_without_a_contribution_has_weight_zero():
    spec = spec_of([joined(weight=5.0), joined(weight=0.0)])
    assert sorted((m.computes, m.weight) for m in spec.members) == [(False, 0.0), (True, 5.0)]


def test_timeouts_follow_the_bytes_and_the_measured_bandwidth():
    members = [joined(), joined(), joined()]
    spec = spec_of(members, size=1_000_000)  # P = 4 MB, equal shares
    ids = [m.peer_id for m in spec.members]
    fast = dict.fromkeys(ids, 1e9)
    slow = {**fast, ids[0]: 1e6}
    duration_fast, _ = round_timeouts(spec, fast, wire_bytes_per_element=4, floor=1, multiplier=3)
    duration_slow, stall_slow = round_timeouts(
        spec, slow, wire_bytes_per_element=4, floor=1, multiplier=3
    )
    # (1 - 1/3) * 4 MB + 1/3 * 4 MB * 2 = 5.33 MB at 1 MB/s, times 3, plus the floor
    assert duration_slow == pytest.approx(1 + 3 * 5.333333, rel=1e-3)
    assert duration_fast < 1.1 and duration_slow > duration_fast
    assert stall_slow == pytest.approx(1 + 3 * 100 * 4 / 1e6)  # one chunk at the slowest
    # Nothing measured: only the floor.
    assert round_timeouts(spec, {}, wire_bytes_per_element=4, floor=2, multiplier=3) == (2, 2)


def _nat_view(count: int, rng: random.Random) -> list[Ticket]:
    """`count` tickets, half of them behind NAT, a third of those symmetric (issue 46's mix)."""
    view = []
    for _ in range(count):
        draw = rng.random()
        capabilities = caps(1e6, reachable=draw >= 0.5, punchable=1 / 6 <= draw < 0.5)
        peer_id = f"peer-{rng.getrandbits(64):016x}"
        ticket = Ticket(peer_id=peer_id, rpc_addrs=[], data_host="h", data_port=1,
                        computes=True, weight=1.0, capabilities=capabilities)  # fmt: skip
        view.append(ticket)
    return sorted(view, key=lambda t: t.peer_id)


def _groups_nobody_can_reduce(seated: list[Ticket], group_size: int) -> int:
    rounds = plan(len(seated), group_size).rounds
    groups = [[seated[i] for i in g] for groups in rounds for g in groups if len(g) > 1]
    return sum(not any(able_to_reduce(g)) for g in groups)


@pytest.mark.parametrize("count", [40, 100, 300])
def test_placed_views_give_every_group_a_member_all_the_others_can_dial(count):
    rng = random.Random(count)
    for _ in range(10):
        view = _nat_view(count, rng)
        # In peer-id order nearly every plan has groups nobody in them can reduce for.
        seated = placed(view, 4, salt=b"view")
        assert sorted(seated, key=lambda t: t.peer_id) == view
        assert _groups_nobody_can_reduce(seated, 4) == 0
        assert placed(list(reversed(view)), 4, salt=b"view") == seated  # every member alike


def test_in_peer_id_order_most_nat_plans_have_a_group_that_cannot_reduce():
    # The baseline the placement is measured against (its docstring's figure).
    rng = random.Random(0)
    views = [_nat_view(100, rng) for _ in range(10)]
    assert all(_groups_nobody_can_reduce(view, 4) > 0 for view in views)


def test_placed_keeps_peer_id_order_when_everyone_or_nobody_says_it_is_reachable():
    view = [joined(caps(1e6)).ticket for _ in range(20)]
    assert placed(view, 4, salt=b"view") == sorted(view, key=lambda t: t.peer_id)
    unmeasured = [msgspec.structs.replace(t, capabilities=None) for t in view]
    assert placed(unmeasured, 4, salt=b"view") == sorted(unmeasured, key=lambda t: t.peer_id)


def test_ground_low_ids_claiming_reachability_do_not_take_the_covering_seats():
    """Reachability is a claim: ranked by peer id, the lowest ids claiming it took the
    numbers that make a peer some groups' only reducer (review). Ranked by the view's digest
    and the id, which ones get them changes with every view."""
    view = _nat_view(100, random.Random(7))
    reachable = [t.peer_id for t in view if t.capabilities.reachable]
    first = placement(100, 4)[:10]
    covering = [
        {placed(view, 4, salt=salt)[n].peer_id for n in first} for salt in (b"a", b"b", b"c")
    ]
    assert all(c <= set(reachable) for c in covering)
    assert all(c != set(reachable[:10]) for c in covering)
    assert len({frozenset(c) for c in covering}) == 3


def test_the_view_digest_names_who_can_be_dialled():
    # Members that read another reachability for one peer seat it elsewhere: their views differ.
    ticket = joined(caps(1e6)).ticket
    behind = msgspec.structs.replace(ticket, capabilities=caps(1e6, reachable=False))
    unmeasured = msgspec.structs.replace(ticket, capabilities=None)
    assert len({view_digest(3, [t]) for t in (ticket, behind, unmeasured)}) == 3
