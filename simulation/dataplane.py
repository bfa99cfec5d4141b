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
from peer.roles.model import bytes_per_round
from simulation.links import carry, carry_parts
from simulation.network import SimNetwork

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
            meeting.everyone.set()
        started = trio.current_time()
        finished = False
        network, ours = self.network, self.ids[me]
        try:
            with trio.move_on_after(max(0.0, deadline - trio.current_time())):
                await meeting.everyone.wait()
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

    async def download(self, joiner: ID, donors: list[ID], size: float) -> None:
        """Wait while `size` bytes come from `donors` (in parallel) to `joiner`; RemoteError
        if every donor has left by then."""
        alive = [d for d in donors if d not in self.network.gone]
        if not alive:
            raise RemoteError("every donor has left")
        network = self.network
        await trio.sleep(max(network.links[d].rtt for d in alive) * 2)  # asking, first bytes
        # The joiner's downlink carries it all, each donor's uplink its part, all shared.
        parts = [(network.uplinks[d], size / len(alive)) for d in alive]
        await carry_parts([(network.downlinks[joiner], size), *parts])
        if all(d in self.network.gone for d in alive):
            raise RemoteError("the donors left during the download")


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
