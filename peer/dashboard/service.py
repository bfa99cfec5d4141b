"""The dashboard as a service: reads the collaboration's records every `dashboard.interval`
seconds into a `History`, and serves it (`server`). A backbone reads through its own DHT node
(`backbone start --dashboard-port`); `peer status --serve` through its status client."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import trio

from peer.config import PeerConfig
from peer.dashboard.history import History
from peer.dashboard.server import serve_dashboard
from peer.errors import RemoteError
from peer.status import StatusReport


async def run_dashboard(
    config: PeerConfig,
    read: Callable[[], Awaitable[StatusReport]],
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the dashboard on `dashboard.host:dashboard.port`, reporting the bound port."""
    history = History()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            serve_dashboard, config.dashboard.host, config.dashboard.port, history.to_json
        )
        task_status.started(port)
        while True:
            with contextlib.suppress(RemoteError):  # no answer this time: the next read
                history.add(await read())
            await trio.sleep(config.dashboard.interval)


__all__ = ["run_dashboard"]
