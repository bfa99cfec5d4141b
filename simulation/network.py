"""A simulated internet for in-process peers: per-peer links, RPCs that take the time the bytes
and the distance take, and peers that leave.

A simulated peer's `SimNode` stands where `peer.net.host.Node` stands for the DHT, the
matchmaker and the trainer: the same attributes they read (`peer_id`, `identity`, `rpc`, `host`,
`announce`, ...), and RPCs served by the same `RpcServer` objects, whose registered handlers
are called directly. A request and its reply are encoded and decoded with msgspec exactly as on
the wire (the decode validates the request type the way the real server does, and no Python
object is ever shared between two peers); a handler's `RpcError`, `RemoteError` or failure
becomes the caller's `RpcError` as the real client sees it.

Time: a message from peer a to peer b takes the one-way latency (half of the mean of the two
peers' round-trip times) and then its bytes carried on a's uplink and b's downlink at once,
each shared equally with everything else on it at that moment (`links`: DHT requests and
replies, tickets, progress records, and the bulk transfers `dataplane` times on the same
links); one wait of the sender's task (`carry(after=latency)`). A fan-out
(`SimRpc.call_each`: a DHT store to a key's holders, a progress read of every shard) is one
wait for all its requests and one for all its replies, each message on its own links: a task
and two waits a call were most of the simulator's time.

A peer that left (`leave`) answers nothing: a call to it fails after the latency if it left
gracefully (its connections closed, as a stopped daemon's do) or at the caller's deadline if it
vanished (a laptop closed, a network gone).

Peers behind NAT (`nat`): a call first gets a connection (`reach`): a live one at once, a new
one through a relay after the circuit's setup, none (no relay holds a slot for the callee)
until the caller's deadline; while a connection runs through a relay, its messages take the
latency to the relay and on, and their bytes are carried on the relay's downlink and uplink
too (`send`). A direct connection costs nothing to open, as always here.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from peer.errors import DeadlineExceeded, RemoteError, RpcError, Unreachable, UserError
from peer.net.identity import Identity
from peer.net.rpc import RpcServer, protocol_id
from simulation import cpu as cpu_module
from simulation.cpu import SimCpu
from simulation.links import SharedLink, carry_groups, carry_parts
from simulation.nat import Nat, NatBook, Path

T = TypeVar("T")

MBIT = 1e6 / 8  # bytes/s


@dataclass(frozen=True)
class Link:
    """One peer's access link."""

    upload: float
    """Bytes/s."""
    download: float
    rtt: float
    """Seconds: round trip to a typical other peer."""


@dataclass(frozen=True)
class LinkDistribution:
    """Where volunteers' links are drawn from. DeDLOC's volunteers (Diskin et al. 2021, sec.
    4.3 and appendix): 10-1000 Mbit/s, 20-300 ms round trips; drawn log-uniformly, upload a
    fraction of download as on home links."""

    min_mbit: float = 10.0
    max_mbit: float = 1000.0
    min_rtt: float = 0.020
    max_rtt: float = 0.300
    upload_fraction: tuple[float, float] = (0.2, 1.0)

    def draw(self, rng: random.Random) -> Link:
        download = log_uniform(rng, self.min_mbit, self.max_mbit) * MBIT
        upload = max(self.min_mbit * MBIT, download * rng.uniform(*self.upload_fraction))
        return Link(
            upload=upload, download=download, rtt=log_uniform(rng, self.min_rtt, self.max_rtt)
        )


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    return low * (high / low) ** rng.random()


@dataclass
class Traffic:
    """What crossed the simulated network, by (service, method)."""

    calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    failed: Counter[tuple[str, str]] = field(default_factory=Counter)
    bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    served: Counter[ID] = field(default_factory=Counter)
    """Reply bytes each peer sent: where the load of a popular key lands."""
    served_as: Counter[tuple[ID, str]] = field(default_factory=Counter)
    """The same by what each reply answered (`served_as_what`): which key's readers it was."""


def served_as_what(method: str, request: object) -> str:
    """What a reply answered, for the windows' busiest node (`simulation.windows`): the method,
    and for a DHT key the family under the collaboration's name ("get progress": the progress
    shards at any level, "get avg": a gathering's tickets)."""
    key = getattr(request, "key", None)
    if not isinstance(key, str):
        return method
    parts = key.split("#", 1)[0].split("/")
    return f"{method} {parts[1] if len(parts) > 1 else parts[0]}"


class SimNetwork:
    def __init__(self, rng: random.Random, *, silent_departures: float = 0.5) -> None:
        """`silent_departures`: the share of departures that answer nothing until a caller's
        deadline (the rest close their connections: calls fail after the latency)."""
        self.rng = rng
        self.silent_departures = silent_departures
        self.links: dict[ID, Link] = {}
        self.uplinks: dict[ID, SharedLink] = {}
        self.downlinks: dict[ID, SharedLink] = {}
        self.cpus: dict[ID, SimCpu] = {}
        self.servers: dict[tuple[ID, str], RpcServer] = {}
        self.gone: dict[ID, bool] = {}  # peer -> left silently
        self.traffic = Traffic()
        self.nat = NatBook(round_trip=self.round_trip, gone=self.gone.__contains__)
        self._addresses = itertools.count(1)

    def node(
        self, link: Link, identity: Identity | None = None, *, nat: Nat = Nat.PUBLIC
    ) -> SimNode:
        if identity is None:  # drawn from the run's seed: the same peer ids every run
            key_pair = create_new_key_pair(self.rng.randbytes(32))
            identity = Identity(
                key_pair=key_pair, peer_id=ID.from_pubkey(key_pair.public_key), path=None
            )
        self.links[identity.peer_id] = link
        self.uplinks[identity.peer_id] = SharedLink(link.upload)
        self.downlinks[identity.peer_id] = SharedLink(link.download)
        self.cpus[identity.peer_id] = SimCpu()
        self.nat.add(identity.peer_id, nat)
        number = next(self._addresses)
        host = f"10.{number >> 16 & 255}.{number >> 8 & 255}.{number & 255}"
        return SimNode(self, identity, host)

    def leave(self, peer_id: ID) -> None:
        self.gone[peer_id] = self.rng.random() < self.silent_departures
        self.nat.forget(peer_id, trio.current_time())
        for key in [k for k in self.servers if k[0] == peer_id]:
            del self.servers[key]

    def rejoin(self, peer_id: ID) -> None:
        """A peer that left comes back with the same identity and link (a restart): its
        services register again as it starts them (a relay: its reservations too)."""
        self.gone.pop(peer_id, None)
        self.nat.rejoin(peer_id)

    def latency(self, a: ID, b: ID) -> float:
        """Seconds a message takes from `a` to `b` before its bytes: the one-way delay."""
        return (self.links[a].rtt + self.links[b].rtt) / 4

    def round_trip(self, a: ID, b: ID) -> float:
        return 2 * self.latency(a, b)

    async def reach(self, a: ID, b: ID) -> None:
        """Until `a` holds a connection to `b` that carries bytes: at once on a live or direct
        one (no checkpoint: runs without NAT schedule as before), after a new circuit's setup,
        never where no relay holds a slot for `b` (its router drops the direct SYN: the
        caller's deadline ends the wait)."""
        connection = self.nat.connection(a, b, trio.current_time())
        if connection.path is Path.FAILED:
            await trio.sleep_forever()
        if connection.ready_at > trio.current_time():
            await trio.sleep_until(connection.ready_at)

    async def send(self, a: ID, b: ID, size: int) -> None:
        """A message of `size` bytes from `a` to `b`: the delay, then its bytes on `a`'s
        uplink and `b`'s downlink, shared with whatever else they carry; through a relay
        while their connection runs through one (`nat`), on the relay's links too."""
        after, parts = self.message(a, b, size, trio.current_time())
        await carry_parts(parts, after=after)

    def message(
        self, a: ID, b: ID, size: int, at: float
    ) -> tuple[float, list[tuple[SharedLink, float]]]:
        """What a message of `size` bytes from `a` to `b` sent at `at` crosses: (its delay,
        the links that carry its bytes)."""
        connection = self.nat.live(a, b, at)
        relay = connection.relay_at(at) if connection is not None else None
        if relay is None:
            return self.latency(a, b), [(self.uplinks[a], size), (self.downlinks[b], size)]
        assert connection is not None
        connection.relayed_bytes += size
        self.nat.tally.relayed_bytes += size
        links = [self.uplinks[a], self.downlinks[relay], self.uplinks[relay], self.downlinks[b]]
        return self.latency(a, relay) + self.latency(relay, b), [(link, size) for link in links]


class SimHost:
    """What an `RpcServer` registers itself on."""

    def __init__(self, network: SimNetwork, peer_id: ID) -> None:
        self.network = network
        self.peer_id = peer_id

    def set_stream_handler(self, protocol: str, handler: Callable[..., Any]) -> None:
        server = getattr(handler, "__self__", None)
        assert isinstance(server, RpcServer), handler  # only RPC services run here
        self.network.servers[(self.peer_id, protocol)] = server


class SimRpc:
    max_message_bytes = 4 << 20

    def __init__(self, network: SimNetwork, peer_id: ID) -> None:
        self.network = network
        self.peer_id = peer_id

    async def call(
        self,
        peer_id: ID,
        service: str,
        method: str,
        request: Any,
        reply_type: type[T],
        *,
        timeout: float,
    ) -> T:
        """`RpcClient.call` over the simulated network."""
        traffic = self.network.traffic
        key = (service, method)
        traffic.calls[key] += 1
        try:
            with trio.fail_after(timeout):
                return await self._call(peer_id, key, request, reply_type)
        except trio.TooSlowError:
            traffic.failed[key] += 1
            raise DeadlineExceeded(
                f"{service}.{method} to {peer_id} took over {timeout:.3g}s"
            ) from None
        except RemoteError:
            traffic.failed[key] += 1
            raise

    async def _call(self, callee: ID, key: tuple[str, str], request: Any, reply_type: type[T]) -> T:
        network, caller = self.network, self.peer_id
        service, method = key
        body = msgspec.msgpack.encode(request)
        network.traffic.bytes[key] += len(body)
        if callee not in network.links:
            raise Unreachable(f"{service}.{method} to {callee}: no such peer")
        await network.cpus[caller].pay()  # what our checks cost goes before what we send
        await network.reach(caller, callee)
        await network.send(caller, callee, len(body))
        server = self._server(callee, key)
        if server is None:
            await trio.sleep_forever()  # a silent departure: until the caller's deadline
        reply, what = await self._serve(server, callee, key, body)
        await network.cpus[callee].pay()
        self._count_reply(key, callee, reply, what)
        await network.send(callee, caller, len(reply))
        if callee in network.gone:
            raise Unreachable(f"{service}.{method} to {callee}: connection closed")
        return msgspec.msgpack.decode(reply, type=reply_type)

    async def call_each(
        self,
        calls: Sequence[tuple[ID, Any]],
        service: str,
        method: str,
        reply_type: type[T],
        *,
        timeout: float,
    ) -> list[T | RemoteError]:
        """`RpcClient.call_each` over the simulated network, as one wait for the requests and
        one for the replies instead of a task and two waits a call (a progress read of 64
        shards is 128 calls): each message still crosses its own links at its own delay,
        shared with everything else on them, and no call outlives `timeout`. What differs
        from calls of their own: every callee serves its request once all the requests have
        arrived (or the deadline came: a request that had not arrived by then fails, and the
        others' replies are late by what the slowest request took over theirs), and the
        callee's checks run beside its reply, from when it starts, instead of before it."""
        network, caller = self.network, self.peer_id
        key = (service, method)
        traffic = network.traffic
        traffic.calls[key] += len(calls)
        deadline = trio.current_time() + timeout
        outcomes: list[T | RemoteError | None] = [None] * len(calls)
        with trio.move_on_at(deadline):  # as each call's own deadline cuts `_call`'s payment
            await network.cpus[caller].pay()
        now = trio.current_time()
        bodies: dict[int, bytes] = {}
        requests: list[tuple[float, list[tuple[SharedLink, float]]]] = []
        encoded: dict[int, bytes] = {}  # a store sends one request to every holder: encoded once
        for index, (callee, request) in enumerate(calls):
            if id(request) not in encoded:
                encoded[id(request)] = msgspec.msgpack.encode(request)
            body = encoded[id(request)]
            traffic.bytes[key] += len(body)
            if callee not in network.links:
                outcomes[index] = Unreachable(f"{service}.{method} to {callee}: no such peer")
                continue
            connection = network.nat.connection(caller, callee, now)
            if connection.path is Path.FAILED:
                continue  # no way in: fails at the deadline
            ready = max(now, connection.ready_at)
            after, parts = network.message(caller, callee, len(body), ready)
            bodies[index] = body
            requests.append((ready - now + after, parts))
        arrived = await carry_groups(requests, deadline=deadline)
        replies: dict[int, bytes] = {}
        answers: list[tuple[float, list[tuple[SharedLink, float]]]] = []
        now = trio.current_time()
        for (index, body), landed in zip(list(bodies.items()), arrived, strict=True):
            callee = calls[index][0]
            try:
                server = self._server(callee, key) if landed else None
                if server is None:
                    continue  # not there by the deadline, or a silent departure
                reply, what = await self._serve(server, callee, key, body)
            except RemoteError as error:
                outcomes[index] = error
                continue
            replies[index] = reply
            self._count_reply(key, callee, reply, what)
            cpu = network.cpus[callee]
            owed, cpu.owed = cpu.owed, 0.0
            after, parts = network.message(callee, caller, len(reply), now)
            answers.append((after, [*parts, (cpu.core, owed)]))
        back = await carry_groups(answers, deadline=deadline)
        for (index, reply), landed in zip(list(replies.items()), back, strict=True):
            callee = calls[index][0]
            if not landed:
                continue
            if callee in network.gone:
                outcomes[index] = Unreachable(f"{service}.{method} to {callee}: connection closed")
                continue
            outcomes[index] = msgspec.msgpack.decode(reply, type=reply_type)
        if trio.current_time() < deadline and any(o is None for o in outcomes):
            await trio.sleep_until(deadline)  # calls nobody answers fail at their deadline
        return [self._outcome(o, key, calls[i][0], timeout) for i, o in enumerate(outcomes)]

    def _outcome(
        self, outcome: T | RemoteError | None, key: tuple[str, str], callee: ID, timeout: float
    ) -> T | RemoteError:
        if outcome is None:
            outcome = DeadlineExceeded(f"{key[0]}.{key[1]} to {callee} took over {timeout:.3g}s")
        if isinstance(outcome, RemoteError):
            self.network.traffic.failed[key] += 1
        return outcome

    def _count_reply(self, key: tuple[str, str], callee: ID, reply: bytes, what: str) -> None:
        traffic = self.network.traffic
        traffic.bytes[key] += len(reply)
        traffic.served[callee] += len(reply)
        traffic.served_as[callee, what] += len(reply)

    def _server(self, callee: ID, key: tuple[str, str]) -> RpcServer | None:
        """The callee's server of `key`'s service (None: it left silently, so nothing answers);
        Unreachable where it refuses the connection (left gracefully, or never served it)."""
        server = self.network.servers.get((callee, protocol_id(key[0])))
        if server is None and not self.network.gone.get(callee):
            raise Unreachable(f"{key[0]}.{key[1]} to {callee}: connection refused")
        return server

    async def _serve(
        self, server: RpcServer, callee: ID, key: tuple[str, str], body: bytes
    ) -> tuple[bytes, str]:
        """The callee's handler on `body`, as its real server runs it: the reply's bytes and
        what it answered (`served_as_what`), or the RpcError its caller gets; what its checks
        cost is owed to its CPU."""
        network, method = self.network, key[1]
        handler = server._methods.get(method)
        if handler is None:
            raise RpcError("unknown_method", f"{key[0]} has no method {method!r}")
        try:
            decoded = msgspec.msgpack.decode(body, type=handler.request_type)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise RpcError("bad_request", f"{method}: {error}") from None
        running = cpu_module.CURRENT.set(network.cpus[callee])  # the checks are the callee's
        try:
            result = await handler.handler(self.peer_id, decoded)  # type: ignore[misc]
        except RpcError:
            raise
        except (RemoteError, UserError) as error:
            raise RpcError("bad_request", str(error)) from None
        except Exception as error:  # the real server logs it and answers "internal"
            raise RpcError("internal", f"the handler failed: {error!r}") from None
        finally:
            cpu_module.CURRENT.reset(running)
        return msgspec.msgpack.encode(result), served_as_what(method, decoded)

    def forget(self, peer_id: ID) -> None:
        pass


class SimNode:
    """A simulated peer's node: what the DHT, the matchmaker and the trainer use of one."""

    def __init__(self, network: SimNetwork, identity: Identity, host: str) -> None:
        self.network = network
        self.identity = identity
        self.peer_id = identity.peer_id
        self.data_host = host
        self.announce = [Multiaddr(f"/ip4/{host}/tcp/4001")]
        self.host = SimHost(network, self.peer_id)
        self.rpc = SimRpc(network, self.peer_id)
        self.network_key_bytes: bytes | None = None

    def public_addrs(self) -> list[str]:
        """Its announced address and, behind NAT, a relayed one (a real peer that is not
        reachable announces one while it holds relay slots: `Node.public_addrs`)."""
        addrs = [str(a) for a in self.announce]
        relays = self.network.nat.relays
        if self.network.nat.kind(self.peer_id) is not Nat.PUBLIC and relays:
            addrs.append(f"/ip4/192.0.2.1/tcp/4001/p2p/{relays[0]}/p2p-circuit/p2p/{self.peer_id}")
        return addrs

    def remember_addrs(self, peer_id: ID, addrs: Sequence[Multiaddr]) -> None:
        pass

    async def connect(self, peer_id: ID, addrs: Sequence[Multiaddr], *, timeout: float) -> None:
        if peer_id not in self.network.links:
            raise Unreachable(f"no peer {peer_id}")
        with trio.move_on_after(timeout):
            await self.network.reach(self.peer_id, peer_id)
            await trio.sleep(self.network.latency(self.peer_id, peer_id) * 2)
            if peer_id in self.network.gone:
                raise Unreachable(f"{peer_id} left")
            return
        raise DeadlineExceeded(f"connecting to {peer_id} took over {timeout:.3g}s")

    async def disconnect(self, peer_id: ID) -> None:
        """The connection closes (behind NAT, the next call may need a relay again)."""
        self.network.nat.drop(self.peer_id, peer_id)
