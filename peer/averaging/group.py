"""What a group agrees on before a round, pure: tickets in, the round's spec and timeouts out.

A `Ticket` is what a peer declares when it is ready to average (in the DHT, for everyone) and
hands the group's leader when it joins: where its data server listens, whether it has a
contribution and its weight, its measured capabilities, and when it was declared. The tickets
a peer reads when the gathering closes are its *view*; `view_digest` names it, so members can
tell whether they planned from the same one. The leader turns the tickets of the members that
joined into a `RoundSpec` (`build_spec`): members sorted by peer id, each with the weight and
block the Moshpit plan gives it (or, in a single group, its own weight), shares from the
shares LP over what trusted backbones measured of each member (`shares_for`: never a member's
own claim, and none above `MAX_SHARE_RATIO` times an equal share), a round id that names
exactly this group and view.

`round_timeouts` replaces magic timeouts: the round may take `floor + multiplier x` the time
the cost model predicts from the bytes each member moves and its measured bandwidth, and a
wait for one peer `floor + multiplier x` one chunk at the slowest member's bandwidth.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Annotated, Literal

import msgspec

from peer.averaging.allreduce import Member, RoundSpec
from peer.averaging.moshpit import placement, plan
from peer.measure.attestation import Evidence, attested_link
from peer.measure.capabilities import Capabilities
from peer.net.tls import MAX_CERT_BYTES
from peer.roles import PeerCapacity, aggregators, cap_shares, optimal_shares
from peer.roles.model import bytes_per_round

Host = Annotated[str, msgspec.Meta(max_length=64)]


class Ticket(msgspec.Struct, frozen=True):
    peer_id: Annotated[str, msgspec.Meta(max_length=128)]
    rpc_addrs: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=256)]], msgspec.Meta(max_length=16)
    ]
    data_host: Host
    data_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    computes: bool
    """It has a contribution this round."""
    weight: Annotated[float, msgspec.Meta(ge=0, le=1e15)]
    """Samples behind its contribution."""
    capabilities: Capabilities | None = None
    declared_at: float = 0.0
    """The collaboration's clock when it was declared: every reader leaves out the tickets
    declared after the gathering closed (the declarer too), so late tickets split no views."""
    aggregation: Literal["mean", "centered_clip"] = "mean"
    """How it reduces its parts: over several Moshpit rounds every member must reduce alike,
    or the groups of the last round would compute different values."""
    size: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 0
    """Elements of its vector (0: not stated, older peers). An aggregator-only member, which
    has no vector, averages the size the tickets of certified-state holders state
    (`stated_size`, `Averager.aggregate`)."""
    probation: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=128)]], msgspec.Meta(max_length=8)
    ] = []
    """Members it saw send nothing in a recent round (`peer.averaging.probation`): a ticket
    that two others of a view name sits that gathering out."""


MAX_AGGREGATE_ELEMENTS = 1 << 30
"""The largest vector (float32 elements, 4 GiB) an aggregator-only member reduces a part of: a
size the tickets state beyond it is refused, so strangers' tickets cannot make it allocate more."""


def stated_size(view: Sequence[Ticket], *, quorum: int) -> int | None:
    """The vector size an aggregator-only member averages (pure): the one at least `quorum`
    computing tickets state, the most stated (ties: the smallest), at most
    MAX_AGGREGATE_ELEMENTS; None if none is. A lone ticket stating another size only makes
    the aggregator refuse specs of that size, as a member."""
    stated = Counter(t.size for t in view if t.computes and 0 < t.size <= MAX_AGGREGATE_ELEMENTS)
    if not stated:
        return None
    size = min(stated, key=lambda s: (-stated[s], s))
    return size if stated[size] >= quorum else None


def view_digest(epoch: int, tickets: Sequence[Ticket]) -> bytes:
    """What a Moshpit plan is made of: who averages with what weight, and what each says of
    its reachability (where each sits, `placed`)."""
    digest = hashlib.blake2b(b"peertrain/view/2", digest_size=16)
    digest.update(str(epoch).encode())
    for t in sorted(tickets, key=lambda t: t.peer_id):
        name = t.peer_id.encode()
        digest.update(len(name).to_bytes(4, "big") + name)
        digest.update(struct.pack(">?dB", t.computes, t.weight, _dialling(t)))
        digest.update(t.aggregation.encode())
    return digest.digest()


def _dialling(ticket: Ticket) -> int:
    """What a ticket says of how it can be dialled: 0 nothing (not measured yet, or an older
    peer), 1 reachable, 2 punchable only, 3 neither (behind a symmetric NAT: client-only)."""
    capabilities = ticket.capabilities
    if capabilities is None:
        return 0
    return 1 if capabilities.reachable else 2 if capabilities.punchable else 3


def placed(view: Sequence[Ticket], group_size: int, *, salt: bytes) -> list[Ticket]:
    """The view's tickets in the order of their Moshpit numbers (pure; every member of the
    view gets the same). Peer-id order unless some of the tickets say they are reachable and
    some say they are not. Then a group whose members cannot dial each other would fail its
    round (tensors never go through a relay): the reachable peers take the numbers that sit
    one in the most groups (`placement`), then the peers behind a symmetric NAT (they reach
    only reachable peers) the numbers whose groups all hold a reachable one, or the fewest
    that do not, then the punchable peers and those that say nothing (not measured yet) the
    rest (a group of punchable and reachable peers reduces: `able_to_reduce`). In peer-id
    order, every plan of 100 peers, half of them behind NAT and a third of those symmetric,
    had groups with nobody to reduce (`tests/test_group.py`).

    Within a class the order is by a hash of `salt` (the view's digest) and the peer id, not
    by peer id: reachability is a peer's claim, and identities with ground ids claiming it
    took the first seats, where they are some groups' only reducers (review). A ticket sent
    last could still grind the digest (docs/SECURITY.md)."""
    by_id = sorted(view, key=lambda t: t.peer_id)
    dialling = {t.peer_id: _dialling(t) for t in by_id}
    if not any(d == 1 for d in dialling.values()) or all(d == 1 for d in dialling.values()):
        return by_id

    def drawn(kind: set[int]) -> list[Ticket]:
        return sorted(
            (t for t in by_id if dialling[t.peer_id] in kind),
            key=lambda t: hashlib.blake2b(salt + t.peer_id.encode(), digest_size=16).digest(),
        )

    reachable = drawn({1})
    order = placement(len(by_id), group_size)
    seats: list[Ticket | None] = [None] * len(by_id)
    for number, ticket in zip(order, reachable, strict=False):
        seats[number] = ticket
    groups = [g for groups in plan(len(by_id), group_size).rounds for g in groups if len(g) > 1]
    exposure = [0] * len(by_id)  # groups of a number that no reachable peer sits in
    for group in groups:
        if all(seats[m] is None for m in group):
            for m in group:
                exposure[m] += 1
    free = sorted(order[len(reachable) :], key=lambda m: (exposure[m], m))
    for number, ticket in zip(free, drawn({3}) + drawn({0, 2}), strict=True):
        seats[number] = ticket
    return [t for t in seats if t is not None]


class Joined(msgspec.Struct, frozen=True):
    """A member as the leader saw it join: its ticket and its data-plane certificate (which
    names its peer id, `peer.net.tls`)."""

    ticket: Ticket
    cert: Annotated[bytes, msgspec.Meta(max_length=MAX_CERT_BYTES)]


def round_id_of(
    epoch: int, round_index: int, leader: str, members: Sequence[str], view: bytes = b""
) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for part in (b"peertrain/round/1", str(epoch).encode(), str(round_index).encode(),
                 leader.encode(), view, *(m.encode() for m in sorted(members))):  # fmt: skip
        digest.update(len(part).to_bytes(4, "big") + part)
    return digest.digest()


def can_reduce(ticket: Ticket | None) -> bool:
    """Whether a ticket says its peer can be dialled: it says it is reachable, or says nothing."""
    return ticket is not None and (ticket.capabilities is None or ticket.capabilities.reachable)


def can_punch(ticket: Ticket | None) -> bool:
    """Whether a ticket says its peer is reachable by hole punching (`Capabilities.punchable`)."""
    return ticket is not None and ticket.capabilities is not None and ticket.capabilities.punchable


def able_to_reduce(
    tickets: Sequence[Ticket | None], declared: Mapping[str, Ticket] | None = None
) -> list[bool]:
    """Who in a group may hold a share, by its ticket or the one it declared in the DHT
    (`declared`: our view): `peer.roles.aggregators` over the group (a peer reachable only by
    hole punching reduces when every member reaches it). More tickets never make fewer able."""
    declared = declared or {}
    seen = [(t, declared.get(t.peer_id)) if t is not None else (None, None) for t in tickets]
    return aggregators(
        [can_reduce(t) or can_reduce(d) for t, d in seen],
        [can_punch(t) or can_punch(d) for t, d in seen],
    )


def attested_bandwidth(ticket: Ticket, evidence: Evidence) -> tuple[float, float] | None:
    """(upload, download) bytes/s trusted backbones measured of `ticket`'s peer, or None."""
    if ticket.capabilities is None:
        return None
    return attested_link(ticket.peer_id, ticket.capabilities.attestations, evidence)


def reducers(tickets: Sequence[Ticket], declared: Mapping[str, Ticket] | None = None) -> list[bool]:
    """Who may hold a share (sorted like `tickets`): whoever can reduce by its ticket, or by the
    ticket it declared in the DHT (`declared`: our view), so a leader never counts fewer
    reducers than a member checking its spec from the DHT tickets does; everyone if nobody."""
    able = able_to_reduce(tickets, declared)
    return able if any(able) else [True] * len(tickets)


def shares_for(
    tickets: Sequence[Ticket],
    *,
    evidence: Evidence | None = None,
    declared: Mapping[str, Ticket] | None = None,
) -> list[float]:
    """Aggregation shares (sorted like `tickets`, adding up to 1): the shares LP
    (`peer.roles.optimal_shares`) for the members' roles (whether each contributes) over their
    bandwidth as trusted backbones measured it (`evidence`), then capped (`cap_shares`).

    Never a ticket's own figures: a member without a valid attestation counts at the floor
    (`averaging.min_bandwidth`), and with no evidence at all every member counts alike (equal
    shares among the reducers). Compute is left out: every member sends its whole vector
    whatever its speed. Reachability is the member's claim (`reducers`): one that claims it and
    cannot be dialed fails as a reducer and is left out (a single group) or fails the round.
    The cap: none holds more than `MAX_SHARE_RATIO` / m of the vector among m reducers.
    """
    able = reducers(tickets, declared)
    computes = [t.computes for t in tickets]
    if sum(computes) <= 1:
        # One contribution or none: nothing to steer by reducing it, nothing to balance.
        return [1.0 if c else 0.0 for c in computes] if any(computes) else _equal(able)
    floor = evidence.floor if evidence is not None else 1.0
    capacities = []
    for ticket, reachable in zip(tickets, able, strict=True):
        measured = attested_bandwidth(ticket, evidence) if evidence is not None else None
        up, down = measured or (floor, floor)
        capacities.append(
            PeerCapacity(
                peer_id=ticket.peer_id, samples_per_s=0.0, upload_bps=up, download_bps=down,
                reachable=reachable,
            )
        )  # fmt: skip
    shares, _ = optimal_shares(capacities, computes)
    return cap_shares(shares, able)


def _equal(able: Sequence[bool]) -> list[float]:
    return [1.0 / sum(able) if a else 0.0 for a in able]


def build_spec(
    joined: Sequence[Joined],
    *,
    epoch: int,
    round_index: int,
    leader: str,
    size: int,
    codec: str,
    chunk_elements: int,
    seats: Mapping[str, tuple[int, float]] | None = None,
    bases: Mapping[str, bytes] | None = None,
    view: bytes = b"",
    evidence: Evidence | None = None,
    declared: Mapping[str, Ticket] | None = None,
) -> RoundSpec:
    """`seats`: each member's (block, weight) from the Moshpit plan, and `bases` the basis
    masks they were seated by; without them every member stands for itself (a single group):
    its own weight, blocks in peer-id order. `evidence` and `declared` (the leader's view of
    the DHT tickets): see `shares_for`."""
    ordered = sorted(joined, key=lambda j: j.ticket.peer_id)
    tickets = [j.ticket for j in ordered]
    shares = shares_for(tickets, evidence=evidence, declared=declared)
    if seats is None:
        seats = {t.peer_id: (i, t.weight if t.computes else 0.0) for i, t in enumerate(tickets)}
    members = tuple(
        Member(
            peer_id=t.peer_id,
            host=t.data_host,
            # Behind a NAT that lets punches in, nothing listens at its data address: members
            # reach it over a libp2p stream at once (port 0), not after a dial times out.
            port=0 if can_punch(t) and not can_reduce(t) else t.data_port,
            computes=t.computes,
            share=share,
            weight=seats[t.peer_id][1],
            cert=j.cert,
            block=seats[t.peer_id][0],
            basis=(bases or {}).get(t.peer_id, b""),
        )
        for j, t, share in zip(ordered, tickets, shares, strict=True)
    )
    return RoundSpec(
        round_id=round_id_of(epoch, round_index, leader, [t.peer_id for t in tickets], view),
        members=members,
        size=size,
        codec=codec,
        chunk_elements=chunk_elements,
        view=view,
    )


def longest_round(
    size: int,
    bandwidth: Sequence[float],
    *,
    wire_bytes_per_element: float,
    floor: float,
    multiplier: float,
) -> float:
    """A bound on any group's round deadline in one averaging: each member moves about twice
    the vector (`round_timeouts` with equal shares), the slowest known member sets the pace."""
    known = [b for b in bandwidth if b > 0]
    if not known:
        return floor
    return floor + multiplier * 2 * size * wire_bytes_per_element / min(known)


def round_timeouts(
    spec: RoundSpec,
    bandwidth: dict[str, float],
    *,
    wire_bytes_per_element: float,
    floor: float,
    multiplier: float,
) -> tuple[float, float]:
    """(seconds the round may take, seconds a wait for one peer may take).

    `bandwidth`: measured bytes/s per member (min of up and down); members without a figure
    count at the slowest known one, or without any figure only the floor applies.
    """
    known = [b for b in bandwidth.values() if b > 0]
    slowest = min(known) if known else 0.0
    sizes = [end - start for start, end in spec.parts()]
    computing = sum(m.computes for m in spec.members)
    longest = 0.0
    for member, part in zip(spec.members, sizes, strict=True):
        share = part / spec.size if spec.size else 0.0
        elements = spec.size * bytes_per_round(
            computes=member.computes, share=share, computing=computing
        )
        rate = bandwidth.get(member.peer_id, 0.0) or slowest
        if rate > 0:
            longest = max(longest, elements * wire_bytes_per_element / rate)
    chunk = spec.chunk_elements * wire_bytes_per_element / slowest if slowest > 0 else 0.0
    return floor + multiplier * longest, floor + multiplier * chunk
