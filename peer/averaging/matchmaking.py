"""Matchmaking: peers ready to average find their Moshpit group and agree on its round spec.

1. **Gather.** Every peer stores its `Ticket` under the DHT key of the averaging epoch (the key
   names the collaboration, the model fingerprint and the epoch, so incompatible models never
   meet), waits for the gathering to close, then reads every ticket afresh: its *view*.
2. **Group.** From its view each peer computes its Moshpit group for the round (`moshpit.py`).
3. **Leader.** The group's leader is its lowest peer id that answers. Each member calls
   `join` on the members below it, lowest first (after a quick `alive` check, so a dead
   candidate costs a quarter of `join_timeout`, not a join's long wait), and leads only if none
   of them answers (or it is the lowest). A leader waits until every member of its view joined, or `join_timeout`,
   then answers every joiner with the same `Begin{spec}`: the members that actually joined,
   so a dead or partitioned peer is out before the all-reduce starts, and a member missing
   from the leader's view but joining anyway is in. Fewer than `min_group_size` members:
   `TooFew`, a clear error for all of them.

Waits only ever go from higher peer ids to lower ones and every wait has a deadline, so
concurrent matchmakers cannot deadlock. A join is accepted only from the peer it names (the
libp2p connection authenticates the caller).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
import trio
from libp2p.peer.id import ID

from peer.averaging.allreduce import RoundSpec
from peer.averaging.group import Joined, Ticket, build_spec
from peer.averaging.moshpit import group_of
from peer.dht.node import DHT
from peer.dht.records import owner_key
from peer.errors import DECODE_ERRORS, PeertrainError, RemoteError, RpcError
from peer.net.host import parse_addrs
from peer.net.rpc import RpcServer

log = logging.getLogger("peertrain.matchmaking")

SERVICE = "avg"
MAX_JOINERS = 256  # per gathering, whatever peers claim


class TooFewPeers(PeertrainError):
    """A group had fewer members than the configured minimum: this round is skipped."""


class Join(msgspec.Struct, frozen=True):
    namespace: Annotated[str, msgspec.Meta(max_length=512)]
    round_index: Annotated[int, msgspec.Meta(ge=0, le=64)]
    joined: Joined


class Alive(msgspec.Struct, frozen=True):
    pass


class Begin(msgspec.Struct, frozen=True, tag=True):
    spec: RoundSpec


class Redirect(msgspec.Struct, frozen=True, tag=True):
    reason: str


class TooFew(msgspec.Struct, frozen=True, tag=True):
    members: int
    needed: int


JoinReply = Begin | Redirect | TooFew


@dataclass
class _Gathering:
    """One (namespace, round) as this peer sees it: who joined us, and what we decided."""

    joined: dict[str, Joined] = field(default_factory=dict)
    arrived: trio.Event = field(default_factory=trio.Event)
    outcome: JoinReply | None = None
    decided: trio.Event = field(default_factory=trio.Event)

    def decide(self, outcome: JoinReply) -> None:
        self.outcome = outcome
        self.decided.set()


@dataclass(frozen=True, kw_only=True)
class RoundShape:
    """What every spec of one averaging call shares."""

    epoch: int
    size: int
    codec: str
    chunk_elements: int


class Matchmaker:
    def __init__(
        self,
        dht: DHT,
        *,
        group_size: int,
        min_group_size: int,
        join_timeout: float,
    ) -> None:
        self.dht = dht
        self.me = dht.node.peer_id.to_base58()
        self.group_size = group_size
        self.min_group_size = min_group_size
        self.join_timeout = join_timeout
        self._gatherings: dict[tuple[str, int], _Gathering] = {}
        self._namespaces: set[str] = set()  # the gatherings we declared in: joins are for these
        server = RpcServer(dht.node.host, SERVICE, max_message_bytes=dht.node.rpc.max_message_bytes)
        server.add_unary("join", Join, self._on_join)
        server.add_unary("alive", Alive, self._on_alive)

    # ------------------------------------------------------------------ gather

    async def declare(self, namespace: str, ticket: Ticket, *, expiration: float) -> None:
        if ticket.peer_id != self.me:
            raise ValueError("a peer declares its own ticket only")
        self._namespaces.add(namespace)
        await self.dht.store(
            namespace, self.me, msgspec.msgpack.encode(ticket), expiration=expiration
        )

    async def read_tickets(self, namespace: str) -> list[Ticket]:
        """Every owner-signed ticket under `namespace` that names its own signer."""
        tickets = []
        for subkey, entry in (await self.dht.get(namespace)).items():
            if owner_key(subkey) is None or entry.value is None:
                continue
            try:
                ticket = msgspec.msgpack.decode(entry.value, type=Ticket)
            except DECODE_ERRORS:
                continue
            if ticket.peer_id == subkey:
                tickets.append(ticket)
        return sorted(tickets, key=lambda t: t.peer_id)

    # ------------------------------------------------------------------ form a group

    async def form_group(
        self, namespace: str, round_index: int, view: list[Ticket], me: Joined, shape: RoundShape
    ) -> RoundSpec:
        """This round's spec for our group; raises TooFewPeers if it is too small.

        `view` are the tickets we read (ours included); `me` our ticket and round key.
        """
        ids = sorted({t.peer_id for t in view} | {self.me})
        group = group_of(ids, self.me, group_size=self.group_size, round_index=round_index)
        tickets = {t.peer_id: t for t in view}
        gathering = self._gathering(namespace, round_index)
        gathering.joined[self.me] = me
        gathering.arrived.set()
        for candidate in group:
            if candidate == self.me:
                return await self._lead(gathering, set(group), namespace, round_index, shape)
            reply = await self._join(candidate, tickets.get(candidate), namespace, round_index, me)
            if isinstance(reply, Begin):
                gathering.decide(Redirect(f"{self.me} joined {candidate}'s group"))
                return reply.spec
            if isinstance(reply, TooFew):
                gathering.decide(reply)
                raise TooFewPeers(_too_few(reply))
        raise AssertionError("unreachable: we are in our own group")

    async def _join(
        self, leader: str, ticket: Ticket | None, namespace: str, round_index: int, me: Joined
    ) -> JoinReply | None:
        """Ask `leader` to take us; None if it cannot (dead, partitioned, redirecting)."""
        try:
            peer_id = ID.from_base58(leader)
            if ticket is not None:
                self.dht.node.remember_addrs(peer_id, parse_addrs(ticket.rpc_addrs))
            # A quick check first: a dead candidate must not cost the long wait of a join,
            # or the real leader would begin without us.
            await self.dht.node.rpc.call(
                peer_id, SERVICE, "alive", Alive(), Alive, timeout=self.join_timeout / 4
            )
            reply = await self.dht.node.rpc.call(
                peer_id,
                SERVICE,
                "join",
                Join(namespace, round_index, me),
                JoinReply,
                timeout=3 * self.join_timeout,  # its own leader search + gathering + slack
            )
        except (RemoteError, ValueError) as error:
            log.debug("candidate leader %s did not take us: %s", leader, error)
            return None
        if isinstance(reply, Begin) and self.me not in [m.peer_id for m in reply.spec.members]:
            return None  # it began without us
        return None if isinstance(reply, Redirect) else reply

    async def _lead(
        self,
        gathering: _Gathering,
        expected: set[str],
        namespace: str,
        round_index: int,
        shape: RoundShape,
    ) -> RoundSpec:
        with trio.move_on_after(self.join_timeout):
            while not expected <= set(gathering.joined):
                gathering.arrived = trio.Event()
                await gathering.arrived.wait()
        members = list(gathering.joined.values())
        if len(members) < self.min_group_size:
            outcome = TooFew(len(members), self.min_group_size)
            gathering.decide(outcome)
            raise TooFewPeers(_too_few(outcome))
        spec = build_spec(
            members,
            epoch=shape.epoch,
            round_index=round_index,
            leader=self.me,
            size=shape.size,
            codec=shape.codec,
            chunk_elements=shape.chunk_elements,
        )
        gathering.decide(Begin(spec))
        return spec

    # ------------------------------------------------------------------ as a candidate leader

    def _gathering(self, namespace: str, round_index: int) -> _Gathering:
        # Only namespaces we declared in (at most a few at a time, `forget` drops them) and
        # at most 65 rounds each: nobody can grow this, or evict a gathering in use.
        return self._gatherings.setdefault((namespace, round_index), _Gathering())

    async def _on_alive(self, caller: ID, request: Alive) -> Alive:
        return request

    async def _on_join(self, caller: ID, request: Join) -> JoinReply:
        who = caller.to_base58()
        if request.joined.ticket.peer_id != who or request.joined.key.peer_id != who:
            raise RpcError("forbidden", "a peer may only join as itself")
        if request.namespace not in self._namespaces:
            return Redirect("not gathering for that epoch")
        gathering = self._gathering(request.namespace, request.round_index)
        if gathering.decided.is_set():
            return gathering.outcome or Redirect("decided")
        if len(gathering.joined) >= MAX_JOINERS:
            raise RpcError("unavailable", f"more than {MAX_JOINERS} peers joined this gathering")
        gathering.joined[who] = request.joined
        gathering.arrived.set()
        try:
            with trio.move_on_after(2 * self.join_timeout):
                await gathering.decided.wait()
        finally:
            if not gathering.decided.is_set():  # it gave up (or hung up): not in the group
                gathering.joined.pop(who, None)
        return gathering.outcome or Redirect("no decision in time")

    def forget(self, namespace: str) -> None:
        """Drop the gatherings of a finished averaging call."""
        self._namespaces.discard(namespace)
        for key in [k for k in self._gatherings if k[0] == namespace]:
            del self._gatherings[key]


def _too_few(reply: TooFew) -> str:
    return (
        f"too few peers to average: the group had {reply.members}, at least {reply.needed} "
        "are needed (start more peers, or lower averaging.min_group_size)"
    )
