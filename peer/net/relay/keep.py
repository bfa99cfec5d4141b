"""A peer's relay slots follow its reachability: while the backbones' dial-back says it is not
reachable inbound (the daemon asks for a verdict: not before the first), it holds a slot on
each backbone and announces the relayed addresses (`Node.public_addrs`); once reachable, it
gives them up."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import trio

from peer.net.host import Node
from peer.net.relay.client import RelayClient, RelayClientConfig

log = logging.getLogger("peertrain.relay")


class RelaySlots:
    """Runs a `RelayClient` on `relays` (full multiaddrs) while `reachable()` is False;
    `wait_reachability()` returns when it may have changed. `run` in the owner's nursery."""

    def __init__(
        self,
        node: Node,
        relays: Sequence[str],
        config: RelayClientConfig,
        *,
        reachable: Callable[[], bool],
        wait_reachability: Callable[[], Awaitable[None]],
    ) -> None:
        self.node = node
        self.relays = list(relays)
        self.config = config
        self.reachable = reachable
        self.wait_reachability = wait_reachability
        self.client: RelayClient | None = None
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Until the relayed addresses we announce have changed."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if self.relays and not self.reachable():
                await self._hold_slots()
            await self.wait_reachability()

    async def _hold_slots(self) -> None:
        client = self.client = RelayClient(self.node, self.relays, self.config)
        log.info("not reachable inbound: reserving relay slots on %d backbones", len(self.relays))
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            self.node.relayed_announce = client.relayed_addrs
            nursery.start_soon(self._forward_changes, client)
            try:
                while not self.reachable():
                    await self.wait_reachability()
            finally:
                self.node.relayed_announce = list
                self.client = None
                nursery.cancel_scope.cancel()
        log.info("reachable inbound: relay slots given up")
        self._notify()

    async def _forward_changes(self, client: RelayClient) -> None:
        while True:
            await client.wait_changed()
            self._notify()
