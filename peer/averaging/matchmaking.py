"""Matchmaking: peers ready to average find their Moshpit group and agree on its round spec.

1. **Gather.** Every peer stores its `Ticket` under the DHT key of the averaging epoch (the key
   names the collaboration, the model fingerprint and the epoch, so incompatible models never
   meet), waits for the gathering to close, then reads every ticket afresh: its *view*.
2. **Group.** From its view each peer computes the Moshpit plan and its group in the round
   (`moshpit.py`); the averager hands `form_group` the group and, when the plan takes more
   than one round, how to seat the members that come (`GroupPlan.seating`: block and weight
   from each one's basis, the peers its value stands for now, `Join.basis`).
3. **Leader.** The group's leader is its lowest reachable peer id that answers. Each member
   calls `join` on the reachable members below it, lowest first (after a quick `alive` check,
   so a dead candidate costs a quarter of `join_timeout`, not a join's long wait), and leads
   only if none of them answers (or it is the lowest); a member that cannot be dialled asks
   every reachable one and never leads a group of others (`leader_candidates`). A leader
   waits until every member of its group joined, or its patience runs out, then answers every
   joiner with the same outcome (a planned round's leader whom nobody joined, with a planned
   member higher than it that leads the round already, joins that one instead:
   `Join.to_leader`):
   - a single group (the plan has one round): `Begin{spec}` with the members that actually
     joined, so a dead or partitioned peer is out before the all-reduce starts and a member
     missing from the leader's view but joining anyway is in; fewer than `min_group_size`:
     `TooFew`.
   - a planned round of several: `Begin{spec}` with the planned members that joined from the
     same view (`Join.view`), seated by their bases; a planned member that has not joined when
     the leader's patience runs out, or that no longer answers, is left out (`moshpit.py`:
     that costs its group, not the step); fewer than 2: `TooFew`.

Waits only ever go toward reachable peers, and among them from higher peer ids to lower
ones, but for a leader's `to_leader` join: it goes to a higher peer that leads (a leader
that joins another takes no `to_leader` join meanwhile), and every wait has a deadline, so
concurrent matchmakers cannot deadlock. A join is accepted only from the peer it names (the
libp2p connection authenticates the caller).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
import trio
from libp2p.peer.id import ID

from peer.averaging.allreduce import RoundSpec
from peer.averaging.group import Joined, Ticket, build_spec, can_punch, can_reduce
from peer.averaging.moshpit import MAX_BASIS_BYTES
from peer.dht.node import DHT
from peer.dht.records import owner_key
from peer.dht.routing import spread_key
from peer.errors import (
    DECODE_ERRORS,
    MalformedReply,
    PeertrainError,
    ProtocolError,
    RemoteError,
    RpcError,
)
from peer.measure.attestation import Evidence
from peer.net.admission import check_dial_address
from peer.net.host import parse_addrs
from peer.net.rpc import RpcServer
from peer.net.tls import certificate_peer_id

log = logging.getLogger("peertrain.matchmaking")

SERVICE = "avg"
MAX_JOINERS = 256  # per gathering, whatever peers claim
BAN_SECONDS = 600.0  # a leader whose spec we refused: neither our leader nor our member
MAX_BANNED = 1024


class TooFewPeers(PeertrainError):
    """A group had fewer members than the configured minimum: this round is skipped."""


class Join(msgspec.Struct, frozen=True):
    namespace: Annotated[str, msgspec.Meta(max_length=512)]
    round_index: Annotated[int, msgspec.Meta(ge=0, le=64)]
    joined: Joined
    view: Annotated[bytes, msgspec.Meta(max_length=32)] = b""
    """The digest of the tickets the joiner planned from (`group.view_digest`)."""
    basis: Annotated[bytes, msgspec.Meta(max_length=MAX_BASIS_BYTES)] = b""
    """In a planned round: the peers the joiner's value stands for (`moshpit.basis_mask`)."""
    to_leader: bool = False
    """Join only if the peer asked leads this round now (else `Redirect` at once). A planned
    round's leader whom nobody joined sends it to a higher member that leads the round: that
    member gave up waiting for us as a candidate leader (we were still in an earlier round)
    and leads it; without it each waited for the other, and both stayed alone (at 300
    simulated peers, 19 of the first step's 101 groups of one waited more than 60 s so)."""


class Alive(msgspec.Struct, frozen=True):
    namespace: Annotated[str, msgspec.Meta(max_length=512)] = ""
    """The averaging asked about: a peer that is not (or no longer) in it answers `unavailable`,
    so it is passed over at once instead of waited for."""
    view: Annotated[bytes, msgspec.Meta(max_length=32)] = b""
    """The asker's view digest (a planned round): a peer that planned from another view
    answers `unavailable` too. It joins the groups of its own plan, never ours: at 300
    simulated peers 4 of 263 read a partial view, and every planned group of theirs waited for
    them as long as its patience, round after round, while they said they were in it."""
    round_index: Annotated[int, msgspec.Meta(ge=-1, le=64)] = -1
    """The round asked about, if any: the answer says whether we lead it (`leading`)."""
    leading: bool = False
    """In an answer: we lead `round_index` and have not begun it yet (`Join.to_leader`)."""


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

    joined: dict[str, Join] = field(default_factory=dict)
    arrived: trio.Event = field(default_factory=trio.Event)
    outcome: JoinReply | None = None
    decided: trio.Event = field(default_factory=trio.Event)
    leading: bool = False
    """We lead this planned round and take `to_leader` joins until we decide."""
    joining: bool = False
    """We lead it but are joining a member that leads it (`Join.to_leader`): joins to us are
    turned away at once, so that their senders go on to that member while it still waits."""

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
    view: bytes = b""
    evidence: Evidence | None = None
    """What counts as a measurement of a member's link, for shares (`group.shares_for`)."""


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """Our group in one round, as our view's plan has it."""

    members: tuple[str, ...]
    """Peer ids, sorted."""
    seating: Callable[[Mapping[str, bytes]], dict[str, tuple[int, float]]] | None = None
    """When the plan takes several rounds: the (block, weight) of each member that came, from
    their basis masks (members with a bad one are left out); None in one group."""
    basis: bytes = b""
    """Our basis mask (a planned round)."""
    patience: float = 0.0
    """Seconds beyond `join_timeout` a leader waits for its members (still in the last round,
    or reading the tickets)."""


class Matchmaker:
    def __init__(
        self,
        dht: DHT,
        *,
        data_host: str,
        group_size: int,
        min_group_size: int,
        join_timeout: float,
    ) -> None:
        self.dht = dht
        self.data_host = data_host  # ours: which joiner addresses our members may dial
        self.me = dht.node.peer_id.to_base58()
        self.group_size = group_size
        self.min_group_size = min_group_size
        self.join_timeout = join_timeout
        self._gatherings: dict[tuple[str, int], _Gathering] = {}
        # The gatherings we declared in (joins are for these), with how long a joiner may
        # wait for our decision beyond 2 join_timeouts (members may still be in a round).
        self._namespaces: dict[str, float] = {}
        self._views: dict[str, bytes] = {}  # the view digest we planned from, per namespace
        self._banned: dict[str, float] = {}  # peer id -> trio time its ban ends
        # Per gathering we declared in: the peers our view seats none of (on probation,
        # `peer.averaging.probation`); a single group's leader takes no join of theirs.
        self._sitting_out: dict[str, frozenset[str]] = {}
        server = RpcServer(dht.node.host, SERVICE, max_message_bytes=dht.node.rpc.max_message_bytes)
        server.add_unary("join", Join, self._on_join)
        server.add_unary("alive", Alive, self._on_alive)

    # ------------------------------------------------------------------ gather

    async def declare(self, namespace: str, ticket: Ticket, *, expiration: float) -> None:
        if ticket.peer_id != self.me:
            raise ValueError("a peer declares its own ticket only")
        # Before our first round: a member whose read of the tickets ended sooner may wait
        # for us that much longer (`Averager._follow_plan` gives a first round that patience).
        self._namespaces[namespace] = self.join_timeout
        await self.dht.store(
            ticket_key(namespace),
            self.me,
            msgspec.msgpack.encode(ticket),
            expiration=expiration,
            hot=True,
        )

    def sit_out(self, namespace: str, peers: Collection[str]) -> None:
        """Our view of `namespace` seats none of `peers`: as its leader we seat none either,
        whoever joins (a peer reads its own view, and may not leave itself out)."""
        if namespace in self._namespaces:
            self._sitting_out[namespace] = frozenset(peers)

    def expect_rounds(self, namespace: str, patience: float, *, view: bytes) -> None:
        """Our averaging in `namespace` takes several rounds of up to `patience` seconds, in
        the plan of the tickets whose digest is `view`: a member of a later round may join us
        that much later, and a member of another view is told we are not its member."""
        if namespace in self._namespaces:
            self._namespaces[namespace] = patience
            self._views[namespace] = view

    async def read_tickets(self, namespace: str) -> list[Ticket]:
        """Every owner-signed ticket under `namespace` that names its own signer (`ticket_key`)."""
        tickets = []
        for subkey, entry in (await self.dht.get(ticket_key(namespace), hot=True)).items():
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
        self,
        namespace: str,
        round_index: int,
        group: GroupPlan,
        view: list[Ticket],
        me: Joined,
        shape: RoundShape,
        *,
        check: Callable[[RoundSpec], str | None] = lambda spec: None,
    ) -> RoundSpec:
        """This round's spec for our group. Raises TooFewPeers (fewer came than a round needs).

        `view` are the tickets we read (ours included); `me` our ticket and certificate.
        `check` says what is wrong with a leader's spec, if anything: that leader is banned
        (`BAN_SECONDS`) and we go on to the next candidate.
        """
        group = dataclasses.replace(
            group, members=tuple(m for m in group.members if not self.banned(m))
        )
        tickets = {t.peer_id: t for t in view}
        gathering = self._gathering(namespace, round_index)
        request = Join(namespace, round_index, me, shape.view, group.basis)
        gathering.joined[self.me] = request
        gathering.arrived.set()
        for candidate in leader_candidates(group.members, self.me, tickets):
            if candidate == self.me:
                return await self._lead(namespace, round_index, group, shape, tickets, check)
            reply = await self._join(
                candidate, tickets.get(candidate), request, group.patience, check
            )
            if isinstance(reply, Begin):
                gathering.decide(Redirect(f"{self.me} joined {candidate}'s group"))
                return reply.spec
            if isinstance(reply, TooFew):
                gathering.decide(reply)
                raise TooFewPeers(_too_few(reply))
        raise AssertionError("unreachable: we are in our own group")

    async def _join(
        self,
        leader: str,
        ticket: Ticket | None,
        request: Join,
        patience: float,
        check: Callable[[RoundSpec], str | None],
    ) -> JoinReply | None:
        """Ask `leader` to take us; None if it cannot (dead, partitioned, redirecting, or its
        spec fails `check`)."""
        try:
            peer_id = ID.from_base58(leader)
            if ticket is not None:
                self.dht.node.remember_addrs(peer_id, parse_addrs(ticket.rpc_addrs))
            # A dead candidate must not cost the long wait of a join, or the real leader
            # would begin without us.
            await self.dht.node.rpc.call(
                peer_id,
                SERVICE,
                "alive",
                Alive(request.namespace, request.view),
                Alive,
                timeout=self.join_timeout / 4,
            )
        except MalformedReply as error:
            self.ban(leader, f"its reply {error}")
            return None
        except (RemoteError, ValueError) as error:
            log.debug("candidate leader %s did not take us: %s", leader, error)
            return None
        # its own leader search + gathering (+ members still in the last round) + slack
        return await self._send_join(
            leader, request, check, timeout=3 * self.join_timeout + patience
        )

    async def _send_join(
        self,
        leader: str,
        request: Join,
        check: Callable[[RoundSpec], str | None],
        *,
        timeout: float,
    ) -> JoinReply | None:
        """`leader`'s reply to our `request`; None if it cannot take us (dead, partitioned,
        redirecting, or it began without us), or if its spec fails `check` (it is banned:
        `BAN_SECONDS`)."""
        try:
            reply = await self.dht.node.rpc.call(
                ID.from_base58(leader), SERVICE, "join", request, JoinReply, timeout=timeout
            )
        except MalformedReply as error:  # e.g. a spec with NaN weights or port 0: its doing
            self.ban(leader, f"its reply {error}")
            return None
        except (RemoteError, ValueError) as error:
            log.debug("candidate leader %s did not take us: %s", leader, error)
            return None
        if isinstance(reply, Begin):
            if self.me not in [m.peer_id for m in reply.spec.members]:
                return None  # it began without us
            problem = check(reply.spec)
            if problem is not None:
                self.ban(leader, f"its spec {problem}")
                return None
        return None if isinstance(reply, Redirect) else reply

    async def _lead(
        self,
        namespace: str,
        round_index: int,
        group: GroupPlan,
        shape: RoundShape,
        tickets: dict[str, Ticket],
        check: Callable[[RoundSpec], str | None],
    ) -> RoundSpec:
        gathering = self._gathering(namespace, round_index)
        expected = set(group.members)
        seats = bases = None
        if group.seating is not None:
            gathering.leading = True
            joined = await self._wait_for_plan(
                namespace, round_index, gathering, group, tickets, shape.view, check
            )
            gathering.leading = False
            if joined is not None:
                gathering.decide(Redirect(f"{self.me} joined a member that leads this round"))
                return joined
            # Planned members from our view (another view plans other groups), seated by
            # what their values stand for; the rest are left out of this round.
            came = {
                p: join
                for p, join in gathering.joined.items()
                if p in expected and join.view == shape.view
            }
            seats = group.seating({p: join.basis for p, join in came.items()})
            bases = {p: came[p].basis for p in seats}
            members = [came[p].joined for p in sorted(seats)]
            needed = 2
        else:
            with trio.move_on_after(self.join_timeout):
                while not expected <= set(gathering.joined):
                    gathering.arrived = trio.Event()
                    await gathering.arrived.wait()
            out = self._sitting_out.get(namespace, frozenset())
            members = [join.joined for p, join in gathering.joined.items() if p not in out]
            needed = self.min_group_size
        if len(members) < needed:
            outcome = TooFew(len(members), needed)
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
            seats=seats,
            bases=bases,
            view=shape.view,
            evidence=shape.evidence,
            declared=tickets,
        )
        gathering.decide(Begin(spec))
        return spec

    async def _wait_for_plan(
        self,
        namespace: str,
        round_index: int,
        gathering: _Gathering,
        group: GroupPlan,
        tickets: dict[str, Ticket],
        view: bytes,
        check: Callable[[RoundSpec], str | None],
    ) -> RoundSpec | None:
        """Wait for every planned member: until all joined, or the patience a round's length
        allows runs out. Members may still be in the previous round, which can be long; the
        missing ones are asked `alive` at once and every `join_timeout` (their RPC answers
        meanwhile), and the wait ends once none of them answers or is still in this
        averaging of our `view`: they are gone. While nobody joined us, a missing member
        higher than us that says it leads this round is joined instead (`Join.to_leader`):
        its spec, if it took us."""
        expected = set(group.members)
        give_up = trio.current_time() + self.join_timeout + group.patience
        ask_at = first = trio.current_time()
        while not expected <= set(gathering.joined):
            if trio.current_time() >= ask_at:
                missing = sorted(expected - set(gathering.joined))
                gone, leading = await self._ask_missing(
                    missing, tickets, namespace, round_index, view, sure=ask_at == first
                )
                if len(gone) == len(missing):
                    log.info("planned member(s) not answering, left out: %s", ", ".join(gone[:3]))
                    return None
                # Lower ones join us; a group of ours goes on as it is. One such member per
                # ask, within our own deadline: a liar that says it leads costs our wait, no
                # more.
                higher = [m for m in leading if m > self.me]
                if higher and set(gathering.joined) == {self.me}:
                    spec = await self._join_leader(higher[0], gathering, give_up, check)
                    if spec is not None:
                        return spec
                ask_at = trio.current_time() + self.join_timeout
                continue  # what joined while we asked counts
            gathering.arrived = trio.Event()
            with trio.move_on_at(min(give_up, ask_at)) as wait:
                await gathering.arrived.wait()
            if wait.cancelled_caught and trio.current_time() >= give_up:
                return None
        return None

    async def _join_leader(
        self,
        leader: str,
        gathering: _Gathering,
        give_up: float,
        check: Callable[[RoundSpec], str | None],
    ) -> RoundSpec | None:
        """Join `leader`, which said it leads this round, as its member (`Join.to_leader`),
        waiting for it until our own `give_up` (and half a join_timeout for the reply): its
        spec, if it took us and the spec passes `check`."""
        left = give_up - trio.current_time()
        if left <= 0:
            return None
        request = msgspec.structs.replace(gathering.joined[self.me], to_leader=True)
        # Nobody joins us meanwhile, as a leader or as ours: they go on to `leader` at once.
        gathering.leading, gathering.joining = False, True
        try:
            reply = await self._send_join(
                leader, request, check, timeout=left + self.join_timeout / 2
            )
        finally:
            # Only we decide our gathering, and not before we stop waiting: still undecided.
            gathering.leading, gathering.joining = True, False
        return reply.spec if isinstance(reply, Begin) else None

    async def _ask_missing(
        self,
        peers: list[str],
        tickets: dict[str, Ticket],
        namespace: str,
        round_index: int,
        view: bytes,
        *,
        sure: bool = False,
    ) -> tuple[list[str], list[str]]:
        """Ask each of `peers` `alive` about `round_index`: (those that do not answer within
        half a join_timeout, or say they are not (or no longer) in the averaging of
        `namespace`, or planned it from another `view`; those that say they lead the round).
        `sure`: only those that say so are gone (a first ask: one slow to dial may still
        join in time)."""
        gone: list[str] = []
        leading: list[str] = []

        async def ask(peer: str) -> None:
            try:
                peer_id = ID.from_base58(peer)
                if (ticket := tickets.get(peer)) is not None:
                    self.dht.node.remember_addrs(peer_id, parse_addrs(ticket.rpc_addrs))
                reply = await self.dht.node.rpc.call(
                    peer_id,
                    SERVICE,
                    "alive",
                    Alive(namespace, view, round_index),
                    Alive,
                    timeout=self.join_timeout / 2,
                )
            except RpcError:
                gone.append(peer)  # its answer
                return
            except (RemoteError, ValueError):
                if not sure:
                    gone.append(peer)
                return
            if reply.leading and reply.round_index == round_index:
                leading.append(peer)

        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(ask, peer)
        return sorted(gone), sorted(leading)

    # ------------------------------------------------------------------ as a candidate leader

    def _gathering(self, namespace: str, round_index: int) -> _Gathering:
        # Only namespaces we declared in (at most a few at a time, `forget` drops them) and
        # at most 65 rounds each: nobody can grow this, or evict a gathering in use.
        return self._gatherings.setdefault((namespace, round_index), _Gathering())

    async def _on_alive(self, caller: ID, request: Alive) -> Alive:
        if request.namespace and request.namespace not in self._namespaces:
            # Not in that averaging (never, or it ended for us): don't wait for us.
            raise RpcError("unavailable", "not in that averaging")
        if self._other_view(request.namespace, request.view):
            raise RpcError("unavailable", "planned from another view of that averaging")
        gathering = self._gatherings.get((request.namespace, request.round_index))
        # `leading` is set only while we wait for members, before we decide (`_lead`).
        return msgspec.structs.replace(request, leading=gathering is not None and gathering.leading)

    def _other_view(self, namespace: str, view: bytes) -> bool:
        """A joiner's or asker's `view` digest differs from the one we planned `namespace`
        from (neither may be known yet: a single group, or we are still reading tickets)."""
        ours = self._views.get(namespace, b"")
        return bool(view and ours and view != ours)

    def ban(self, peer_id: str, reason: str) -> None:
        """Leave `peer_id` out of our groups for BAN_SECONDS: as our leader and as our member."""
        log.info("not averaging with %s for %.0f s: %s", peer_id, BAN_SECONDS, reason)
        if len(self._banned) >= MAX_BANNED:
            self._banned.pop(min(self._banned, key=self._banned.__getitem__))
        self._banned[peer_id] = trio.current_time() + BAN_SECONDS

    def banned(self, peer_id: str) -> bool:
        until = self._banned.get(peer_id)
        if until is not None and trio.current_time() >= until:
            del self._banned[peer_id]
            return False
        return until is not None

    async def _on_join(self, caller: ID, request: Join) -> JoinReply:
        who = caller.to_base58()
        if self.banned(who):
            return Redirect("not averaging with you for now")
        if request.joined.ticket.peer_id != who:
            raise RpcError("forbidden", "a peer may only join as itself")
        patience = self._namespaces.get(request.namespace)
        if patience is None:
            return Redirect("not gathering for that epoch")
        if who in self._sitting_out.get(request.namespace, ()):
            return Redirect("sitting out: members of this averaging saw you send nothing")
        if self._other_view(request.namespace, request.view):
            return Redirect("planned from another view: not in our group")
        # What we list, our members check: a joiner they cannot use would make them refuse our
        # spec (and ban us), so it is refused here.
        ticket = request.joined.ticket
        try:
            if certificate_peer_id(request.joined.cert) != who:
                raise RpcError("forbidden", "a peer may only join with its own certificate")
            check_dial_address(ticket.data_host, ticket.data_port, own_host=self.data_host)
        except ProtocolError as error:
            raise RpcError("bad_request", str(error)) from None
        gathering = self._gathering(request.namespace, request.round_index)
        if gathering.decided.is_set():
            return gathering.outcome or Redirect("decided")
        if request.to_leader and not gathering.leading:
            return Redirect("not leading that round")
        if gathering.joining:
            return Redirect("joining the member that leads this round")
        if len(gathering.joined) >= MAX_JOINERS:
            raise RpcError("unavailable", f"more than {MAX_JOINERS} peers joined this gathering")
        gathering.joined[who] = request
        gathering.arrived.set()
        try:
            with trio.move_on_after(2 * self.join_timeout + patience):
                await gathering.decided.wait()
        finally:
            if not gathering.decided.is_set():  # it gave up (or hung up): not in the group
                gathering.joined.pop(who, None)
        return gathering.outcome or Redirect("no decision in time")

    def forget(self, namespace: str) -> None:
        """Drop the gatherings of a finished averaging call."""
        self._namespaces.pop(namespace, None)
        self._views.pop(namespace, None)
        self._sitting_out.pop(namespace, None)
        for key in [k for k in self._gatherings if k[0] == namespace]:
            del self._gatherings[key]


def ticket_key(namespace: str) -> str:
    """The DHT key of a gathering's tickets: a hot key spread over the nodes of a 1-bit prefix
    (`routing.spread_key`; `SPREAD_HOLDERS` x `replicas` holders, not `replicas`), read whole
    from two of them. Every member reads it at the same moment, the gathering's close: read
    from every replica a lookup met, each of the 8 replicas sent each of 264 readers a full
    reply at once at 300 simulated peers, and a read took 14 s (median); from two of the 8,
    12.5 s; from two of 24 holders, 1.5 s (docs/scale.md, Session 32)."""
    return spread_key(namespace, 1, 0)


def leader_candidates(members: Sequence[str], me: str, tickets: Mapping[str, Ticket]) -> list[str]:
    """Whom we ask to lead our group, in order, ending with ourselves (we lead if none takes
    us). A member whose ticket says it cannot be dialled (behind NAT, client-only; a peer
    reachable by hole punching can be) never leads:
    nobody could join it, and two such peers each led a group of one for a whole run. So a
    reachable member asks the reachable ones below it, an unreachable one every reachable one;
    waits still only go toward reachable peers, lower ones among them: no deadlock."""

    def dialable(peer_id: str) -> bool:
        # A peer reached by hole punching answers joins over its relayed connection meanwhile.
        ticket = tickets.get(peer_id)
        return ticket is None or can_reduce(ticket) or can_punch(ticket)

    reachable = sorted(m for m in members if m != me and dialable(m))
    if dialable(me):
        return [m for m in reachable if m < me] + [me]
    return [*reachable, me]


def _too_few(reply: TooFew) -> str:
    return (
        f"too few peers to average: the group had {reply.members}, at least {reply.needed} "
        "are needed (start more peers, or lower averaging.min_group_size)"
    )
