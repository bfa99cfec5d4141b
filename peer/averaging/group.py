"""What a group agrees on before a round, pure: tickets in, the round's spec and timeouts out.

A `Ticket` is what a peer declares when it is ready to average (in the DHT, for everyone) and
hands the group's leader when it joins: where its data server listens, whether it has a
contribution and its weight, its measured capabilities, and when it was declared. The tickets
a peer reads when the gathering closes are its *view*; `view_digest` names it, so members can
tell whether they planned from the same one. The leader turns the tickets of the members that
joined into a `RoundSpec` (`build_spec`): members sorted by peer id, each with the weight and
block the Moshpit plan gives it (or, in a single group, its own weight), shares from the role
solver when every member's capabilities are known (else equal shares among the reachable
members), a round id that names exactly this group and view.

`round_timeouts` replaces magic timeouts: the round may take `floor + multiplier x` the time
the cost model predicts from the bytes each member moves and its measured bandwidth, and a
wait for one peer `floor + multiplier x` one chunk at the slowest member's bandwidth.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Annotated, Literal

import msgspec

from peer.averaging.allreduce import Member, RoundSpec
from peer.errors import RoleAssignmentError
from peer.measure.capabilities import Capabilities, to_capacity
from peer.net.tls import MAX_CERT_BYTES
from peer.roles import assign_roles
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


def view_digest(epoch: int, tickets: Sequence[Ticket]) -> bytes:
    """What a Moshpit plan is made of: who averages (in peer-id order) with what weight."""
    digest = hashlib.blake2b(b"peertrain/view/1", digest_size=16)
    digest.update(str(epoch).encode())
    for t in sorted(tickets, key=lambda t: t.peer_id):
        name = t.peer_id.encode()
        digest.update(len(name).to_bytes(4, "big") + name)
        digest.update(struct.pack(">?d", t.computes, t.weight) + t.aggregation.encode())
    return digest.digest()


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


def shares_for(tickets: Sequence[Ticket], *, size: int) -> list[float]:
    """Aggregation shares (sorted like `tickets`): the role solver's, given every member's
    measured capabilities; otherwise equal among the members known to be reachable."""
    capacities = [
        to_capacity(t.peer_id, t.capabilities) if t.capabilities else None for t in tickets
    ]
    if all(c is not None for c in capacities):
        try:
            assignment = assign_roles(
                [c for c in capacities if c is not None],
                gradient_bytes=4 * max(size, 1),
                target_batch=max(sum(t.weight for t in tickets), 1.0),
                delayed=False,
            )
            return [role.share for role in assignment.roles]
        except RoleAssignmentError:
            pass  # nobody measured as reachable: fall back below
    reachable = [t.capabilities is None or t.capabilities.reachable for t in tickets]
    if not any(reachable):
        reachable = [True] * len(tickets)  # no one known reachable: try everyone
    return [1.0 if r else 0.0 for r in reachable]


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
    view: bytes = b"",
) -> RoundSpec:
    """`seats`: each member's (block, weight) from the Moshpit plan; without them every member
    stands for itself (a single group): its own weight, blocks in peer-id order."""
    ordered = sorted(joined, key=lambda j: j.ticket.peer_id)
    tickets = [j.ticket for j in ordered]
    shares = shares_for(tickets, size=size)
    if seats is None:
        seats = {t.peer_id: (i, t.weight if t.computes else 0.0) for i, t in enumerate(tickets)}
    members = tuple(
        Member(
            peer_id=t.peer_id,
            host=t.data_host,
            port=t.data_port,
            computes=t.computes,
            share=share,
            weight=seats[t.peer_id][1],
            cert=j.cert,
            block=seats[t.peer_id][0],
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
