"""Test helpers: in-process libp2p nodes on loopback."""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from peer.config import DhtConfig
from peer.dht.node import DHT
from peer.dht.routing import node_id
from peer.net.host import Node, open_node
from peer.net.identity import Identity, ephemeral_identity
from peer.net.tls import DataIdentity

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:  # no IPv6 here (a container may have it off)
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) here")


new_identity = ephemeral_identity


def load_factor(*, cap: float = 4.0) -> float:
    """How much slower than an idle machine wall-clock waits run now: the runnable processes
    per core (the 1-minute load average, this test's own included), at least 1, at most `cap`.
    In-process collaborations (many DHT nodes and trainers on one event loop and one GIL)
    scale their real-time windows and deadlines by it, so a machine busy with other work
    stretches them instead of failing them; an idle CI machine keeps the short ones."""
    import os

    return min(cap, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


@asynccontextmanager
async def nodes(count: int, *, max_message_bytes: int = 1 << 20) -> AsyncIterator[list[Node]]:
    """`count` running nodes listening on 127.0.0.1, closed on exit."""
    async with AsyncExitStack() as stack:
        out = []
        for _ in range(count):
            node = await stack.enter_async_context(
                open_node(
                    new_identity(),
                    listen=[LOOPBACK],
                    announce=[],
                    max_message_bytes=max_message_bytes,
                )
            )
            out.append(node)
        yield out


class FakeClock:
    """A wall clock the test moves by hand; `offset` models one node's skew."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def skewed(self, offset: float) -> Callable[[], float]:
        return lambda: self.now + offset


class Swarm:
    """N DHT server nodes in one process; node i can be killed on its own."""

    def __init__(self, nursery: trio.Nursery, config: DhtConfig, clock: FakeClock | None) -> None:
        self.nursery = nursery
        self.config = config
        self.clock = clock
        self.dhts: list[DHT] = []
        self._scopes: list[trio.CancelScope] = []

    async def add(self, *, offset: float = 0.0, bootstrap: bool = True) -> DHT:
        clock = self.clock.skewed(offset) if self.clock else time.time
        scope = trio.CancelScope()

        async def run(task_status: trio.TaskStatus[DHT]) -> None:
            with scope:
                async with open_node(
                    new_identity(), listen=[LOOPBACK], announce=[], max_message_bytes=1 << 20
                ) as node:
                    dht = DHT(node, self.config, server=True, rpc_timeout=5.0, clock=clock)
                    async with trio.open_nursery() as inner:
                        await inner.start(dht.run)
                        task_status.started(dht)
                        await trio.sleep_forever()

        dht = await self.nursery.start(run)
        if bootstrap and self.dhts:
            first = self.dhts[0].node
            assert await dht.bootstrap([(first.peer_id, first.announce[0])])
        self.dhts.append(dht)
        self._scopes.append(scope)
        return dht

    def kill(self, index: int) -> None:
        self._scopes[index].cancel()


@asynccontextmanager
async def swarm(
    count: int,
    config: DhtConfig,
    *,
    clock: FakeClock | None = None,
    offsets: list[float] | None = None,
) -> AsyncIterator[Swarm]:
    async with trio.open_nursery() as nursery:
        s = Swarm(nursery, config, clock)
        for i in range(count):
            await s.add(offset=offsets[i] if offsets else 0.0)
        # Everyone refreshes once more so early nodes learn of late ones.
        for dht in s.dhts:
            await dht.find_nodes(node_id(dht.node.peer_id))
        yield s
        nursery.cancel_scope.cancel()


class ForwardingStream(trio.abc.Stream):
    """A stream that passes everything to `inner`: tests subclass it and override `send_all`
    to script a donor's data connection (delay, corrupt, hang)."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


class CuttingRelay:
    """A TCP relay on 127.0.0.1 in front of `target_port` that cuts every connection at once
    when `limit` bytes have gone back to its clients: a member killed in the middle of an
    all-reduce, after it returned some averages (put it in a member's ticket as its data port).
    """

    def __init__(self, target_port: int, *, limit: int) -> None:
        self.target_port = target_port
        self.limit = limit
        self.returned = 0
        self.cut = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, host="127.0.0.1"), self._relay, 0
            )
            task_status.started(listeners[0].socket.getsockname()[1])

    async def _relay(self, client: trio.SocketStream) -> None:
        if self.cut.is_set():
            await client.aclose()
            return
        try:
            async with (
                client,
                await trio.open_tcp_stream("127.0.0.1", self.target_port) as server,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(self._pipe, client, server, False)
                nursery.start_soon(self._pipe, server, client, True)
                await self.cut.wait()
                nursery.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    async def _pipe(self, src: trio.SocketStream, dst: trio.SocketStream, back: bool) -> None:
        async for data in src:
            if back:
                data = data[: max(0, self.limit - self.returned)]
                self.returned += len(data)
            await dst.send_all(data)
            if back and self.returned >= self.limit:
                self.cut.set()
                return


def data_identity(identity: Identity) -> DataIdentity:
    """The data-plane TLS certificate (and contexts) of `identity`."""
    return DataIdentity(identity.key_pair.private_key, identity.peer_id.to_base58())
