"""The dashboard as a service: reads the collaboration's records every `dashboard.interval`
seconds into a `History`, and serves it (`server`). A backbone reads through its own DHT node
(`backbone start --dashboard-port`); `peer status --serve` through its status client."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from peer.config import PeerConfig
from peer.dashboard.history import History
from peer.dashboard.server import encode, serve_dashboard
from peer.errors import RemoteError
from peer.status import StatusReport

log = logging.getLogger("peertrain.dashboard")


async def run_dashboard(
    config: PeerConfig,
    read: Callable[[], Awaitable[StatusReport]],
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the dashboard on `dashboard.host:dashboard.port`, reporting the bound port."""
    history = History()
    document = encode(history.to_json())  # encoded once per read, served as it is

    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            serve_dashboard, config.dashboard.host, config.dashboard.port, lambda: document
        )
        task_status.started(port)
        while True:
            try:
                history.add(await read())
                document = encode(history.to_json())
            except RemoteError:
                pass  # no answer this time: the next read
            except Exception:  # records anyone can publish: a bug of ours they found, logged
                log.exception("dashboard: reading the collaboration failed; reading again")
            await trio.sleep(config.dashboard.interval)


__all__ = ["run_dashboard"]
