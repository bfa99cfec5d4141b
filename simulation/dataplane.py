"""The bulk transfers of a simulated collaboration: all-reduce rounds and state downloads.

`SimDataPlane.allreduce` stands in for `peer.averaging.allreduce.allreduce` (`simulated` swaps
it in for the averager): the members of a round meet by its round id; once all have arrived the
round lasts as long as the butterfly all-reduce of the *simulated* model's bytes takes over the
members' links (each member sends and receives its share of the traffic, `bytes_per_round`, on
its own uplink and downlink, shared with whatever else they carry then: `links`; the last
member to finish sets the length), plus a round trip. Every member then holds the same bits:
the weighted mean of the computing members' values, added in the order the real reducers add
them ((block, peer id)). A member that never arrives, or that leaves before the round ends,
fails the round for everyone in it, as a dead reducer does (reported as a dropped sender and a
failed reducer), which is what the averager's retry and refusal logic reads.

Behind NAT (`simulation.nat`): relays carry no tensors. A sender reaches a reducer behind NAT
over their libp2p connection once it is direct: at once on a live direct one, after the hole
punch on a new one (and, first, the direct dial's `DIRECT_TIMEOUT` where the reducer gave a
data address nothing answers at: a symmetric NAT); a pair with no direct connection, or one
not made within the stall timeout, is cut. A round with a cut pair fails after the stall
timeout as the real one does: the sender names the reducer it could not reach, everyone else
the sender whose contribution that reducer's part lacks (the rest of the bytes are carried as
if it had not failed). A joiner reaches donors behind NAT the same way; those with no direct
connection serve none of the download.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import trio
from libp2p.peer.id import ID

from peer.averaging import averager as averager_module
from peer.averaging.allreduce import RoundReport, RoundSpec
from peer.averaging.reduce import ChunkResult
from peer.errors import RemoteError
from peer.net.streamio import DIRECT_TIMEOUT, PUNCH_SECONDS
from peer.roles.model import bytes_per_round
from simulation.links import carry, carry_parts
from simulation.nat import Nat, Path
from simulation.network import SimNetwork

NO_PATH = "no direct connection, only relayed: relays carry no tensors"

T = TypeVar("T")


@dataclass
class _Meeting:
    arrived: dict[str, np.ndarray] = field(default_factory=dict)
    everyone: trio.Event = field(default_factory=trio.Event)
    average: np.ndarray | None = None
    carried: set[str] = field(default_factory=set)
    """Members whose bytes their links carried."""
    settled: trio.Event = field(default_factory=trio.Event)
    """Every member's bytes carried, or one stopped half-way (it left, or its deadline)."""
    returned: int = 0
    met_at: float = 0.0
    setup: dict[str, float] = field(default_factory=dict)
    """Seconds each member waits for its connections to reducers behind NAT."""
    cut: dict[str, set[str]] = field(default_factory=dict)
    """Sender -> the reducers it has no direct connection to."""


@dataclass(frozen=True)
class SimIdentity:
    peer_id: str
    certificate: bytes


@dataclass(frozen=True)
class SimDataServer:
    """What the averager reads of its `DataServer`."""

    identity: SimIdentity


class SimDataPlane:
    def __init__(self, network: SimNetwork, *, model_bytes: float) -> None:
        """`model_bytes`: the simulated model's gradient on the wire (a vector's real size)."""
        self.network = network
        self.model_bytes = model_bytes
        self.ids: dict[str, ID] = {}
        self._meetings: dict[bytes, _Meeting] = {}

    def register(self, peer_id: ID) -> None:
        self.ids[peer_id.to_base58()] = peer_id

    def gone(self, peer_id: str) -> bool:
        return self.ids[peer_id] in self.network.gone

    def moved(self, spec: RoundSpec, peer_id: str) -> float:
        """The bytes `peer_id` sends (and as many it receives) in `spec`'s butterfly of
        `model_bytes`: its share of the reducing, and its own parts if it computes."""
        computing = sum(m.computes for m in spec.members)
        for member, (start, end) in zip(spec.members, spec.parts(), strict=True):
            if member.peer_id == peer_id:
                share = (end - start) / spec.size if spec.size else 0.0
                return self.model_bytes * bytes_per_round(
                    computes=member.computes, share=share, computing=computing
                )
        raise KeyError(peer_id)

    def round_seconds(self, spec: RoundSpec) -> float:
        """The butterfly all-reduce among `spec`'s members on links that carry nothing else:
        the slowest member's bytes, up and down at once, and the longest round trip."""
        longest = 0.0
        for member in spec.members:
            moved = self.moved(spec, member.peer_id)
            link = self.network.links[self.ids[member.peer_id]]
            longest = max(longest, moved / link.upload, moved / link.download)
        rtt = max(self.network.links[self.ids[m.peer_id]].rtt for m in spec.members)
        return longest + rtt

    async def allreduce(
        self,
        spec: RoundSpec,
        vector: np.ndarray,
        server: SimDataServer,
        *,
        deadline: float,
        stall_timeout: float,
        norm_factor: float | None = None,
    ) -> RoundReport:
        me = server.identity.peer_id
        meeting = self._meetings.setdefault(spec.round_id, _Meeting())
        meeting.arrived[me] = vector.copy()
        members = [m.peer_id for m in spec.members]
        computing = tuple(m.peer_id for m in spec.members if m.computes)
        if all(m in meeting.arrived for m in members) and meeting.average is None:
            meeting.average = _weighted_mean(spec, meeting.arrived)
            meeting.met_at = trio.current_time()
            self._connect(spec, meeting, stall_timeout)
            meeting.everyone.set()
        started = trio.current_time()
        finished = False
        network, ours = self.network, self.ids[me]
        try:
            with trio.move_on_after(max(0.0, deadline - trio.current_time())):
                await meeting.everyone.wait()
                if meeting.setup.get(me, 0.0) > 0:  # no checkpoint without NAT: as before
                    await trio.sleep(meeting.setup[me])
                try:  # our parts up and the reduced parts down, sharing our links
                    await carry(
                        self.moved(spec, me), network.uplinks[ours], network.downlinks[ours]
                    )
                except BaseException:  # we left, or our deadline came: the round fails
                    meeting.settled.set()
                    raise
                meeting.carried.add(me)
                if meeting.carried.issuperset(members):
                    meeting.settled.set()
                await meeting.settled.wait()
                await trio.sleep(max(network.links[self.ids[m]].rtt for m in members))
                if meeting.cut:  # the reducers wait out the senders that never came
                    await trio.sleep_until(max(trio.current_time(), meeting.met_at + stall_timeout))
                finished = True
        finally:
            # Forgotten once everyone who came is done: one who comes later meets nobody.
            meeting.returned += 1
            if meeting.returned == len(meeting.arrived):
                self._meetings.pop(spec.round_id, None)
        left = [m for m in members if m != me and (m not in meeting.carried or self.gone(m))]
        late = not finished
        if left or late:
            others = [m for m in members if m != me] or [me]
            failed = dict.fromkeys(left, "did not take part") or dict.fromkeys(
                others, "the round ran out of time"
            )
            return RoundReport(
                chunks=[ChunkResult(0, spec.size, 0)],
                computing=computing,
                dropped_senders=failed,
                failed_reducers=dict(failed),
                seconds=trio.current_time() - started,
            )
        if meeting.cut:
            unreached = meeting.cut.get(me, set())
            lacking = set() if unreached else set(meeting.cut)  # senders missing from a part
            return RoundReport(
                chunks=[ChunkResult(0, spec.size, 0)],
                computing=computing,
                dropped_senders=dict.fromkeys(sorted(lacking), NO_PATH),
                failed_reducers=dict.fromkeys(sorted(unreached), NO_PATH),
                seconds=trio.current_time() - started,
            )
        assert meeting.average is not None
        vector[:] = meeting.average
        index = members.index(me)
        start, end = spec.parts()[index]
        return RoundReport(
            chunks=[ChunkResult(0, spec.size, len(computing), frozenset(computing))],
            computing=computing,
            reduced=(end - start) / spec.size if spec.size else 0.0,
            seconds=trio.current_time() - started,
        )

    def _connect(self, spec: RoundSpec, meeting: _Meeting, stall_timeout: float) -> None:
        """Each sender's connections to the reducers behind NAT (module doc): how long it
        waits for them (`meeting.setup`), and the pairs cut (`meeting.cut`)."""
        nat, now = self.network.nat, trio.current_time()
        reducers = [m for m in spec.members if m.share > 0]
        meeting.setup, meeting.cut = {}, {}
        for sender in spec.members:
            if not sender.computes:
                continue
            for reducer in reducers:
                if reducer.peer_id == sender.peer_id:
                    continue
                ours, theirs = self.ids[sender.peer_id], self.ids[reducer.peer_id]
                if nat.kind(theirs) is Nat.PUBLIC:
                    continue  # TLS to its data address
                at = now + (DIRECT_TIMEOUT if reducer.has_data_address else 0.0)
                connection = nat.connection(ours, theirs, at)
                wait = max(connection.direct_at, at) - now
                if not connection.carries_tensors or wait > stall_timeout:
                    path = connection.path if not connection.carries_tensors else Path.FAILED
                    nat.tally.reducer_paths[path] += 1
                    meeting.cut.setdefault(sender.peer_id, set()).add(reducer.peer_id)
                    continue
                nat.tally.reducer_paths[
                    Path.PUNCHED if connection.direct_at > at else Path.DIRECT
                ] += 1
                meeting.setup[sender.peer_id] = max(meeting.setup.get(sender.peer_id, 0.0), wait)
        nat.tally.rounds_cut += bool(meeting.cut)
        nat.tally.planned.append(
            tuple((nat.kind(self.ids[m.peer_id]), m.share > 0) for m in spec.members)
        )

    async def download(
        self, joiner: ID, donors: list[ID], size: float, *, parallel: int = 3
    ) -> None:
        """Wait while `size` bytes come to `joiner` from the first `parallel` of `donors` (in
        their order) it gets a direct connection to, as `StateDownload` asks them; RemoteError
        if every donor has left by then, or none has a direct connection to it (NAT)."""
        alive = [d for d in donors if d not in self.network.gone]
        if not alive:
            raise RemoteError("every donor has left")
        network = self.network
        alive, setup = self._reach_donors(joiner, alive, parallel)
        if not alive:
            await trio.sleep(setup)
            raise RemoteError(f"no state donor reachable: {NO_PATH}")
        if setup > 0:
            await trio.sleep(setup)
        await trio.sleep(max(network.links[d].rtt for d in alive) * 2)  # asking, first bytes
        # The joiner's downlink carries it all, each donor's uplink its part, all shared.
        parts = [(network.uplinks[d], size / len(alive)) for d in alive]
        await carry_parts([(network.downlinks[joiner], size), *parts])
        if all(d in self.network.gone for d in alive):
            raise RemoteError("the donors left during the download")

    def _reach_donors(self, joiner: ID, donors: list[ID], parallel: int) -> tuple[list[ID], float]:
        """The first `parallel` donors, in order, that `joiner` gets a direct connection to
        (those it tries before are dialed and fail), and the seconds until the last of them is
        up; with none, the seconds until it knows (its data address first, then the punch, at
        most `PUNCH_SECONDS`)."""
        nat, now = self.network.nat, trio.current_time()
        usable, waits, failing = [], [0.0], [0.0]
        for donor in donors:
            if len(usable) == parallel:
                break
            if nat.kind(donor) is Nat.PUBLIC:
                usable.append(donor)
                continue
            at = now + DIRECT_TIMEOUT  # its data address answers nothing
            connection = nat.connection(joiner, donor, at)
            if connection.carries_tensors:
                usable.append(donor)
                waits.append(max(connection.direct_at, at) - now)
                nat.tally.donor_paths[
                    Path.PUNCHED if connection.direct_at > at else Path.DIRECT
                ] += 1
            else:
                nat.tally.donor_paths[connection.path] += 1
                settled = min(connection.settled_at, connection.ready_at + PUNCH_SECONDS)
                failing.append(max(settled, at) - now)
        return usable, max(waits) if usable else max(failing)


def _weighted_mean(spec: RoundSpec, values: dict[str, np.ndarray]) -> np.ndarray:
    total = np.zeros(spec.size, dtype=np.float64)
    weight = 0.0
    for member in sorted(spec.members, key=lambda m: (m.block, m.peer_id)):
        if member.computes and member.weight > 0:
            total += member.weight * values[member.peer_id].astype(np.float64)
            weight += member.weight
    return (total / weight if weight else total).astype(np.float32)


async def _inline(fn: Callable[..., T], *args: Any, **_: Any) -> T:
    """`trio.to_thread.run_sync`, on the loop: a simulated peer's thread work (copies of a
    64-value vector) takes no time. In a real thread the virtual clock would jump while it ran
    by however far the loop got meanwhile: the machine's load would set virtual times."""
    await trio.lowlevel.checkpoint()
    return fn(*args)


@contextlib.contextmanager
def simulated(plane: SimDataPlane) -> Iterator[None]:
    """While this lasts, the averager's all-reduce is `plane`'s and worker threads run inline
    (`_inline`)."""
    real_allreduce, real_run_sync = averager_module.allreduce, trio.to_thread.run_sync
    averager_module.allreduce = plane.allreduce  # type: ignore[assignment]
    trio.to_thread.run_sync = _inline  # type: ignore[assignment]
    try:
        yield
    finally:
        averager_module.allreduce = real_allreduce
        trio.to_thread.run_sync = real_run_sync
