"""The dashboard's web server: one page (`page.html` and its script `page.js`, no external
assets) and its data as JSON
(`/api/state`), over HTTP/1.1 parsed by h11 on trio. Read-only, and it serves only what the
collaboration's public records say; it listens on 127.0.0.1 unless told otherwise.

Every connection is bounded: at most `MAX_CONNECTIONS` at once (more are closed unanswered),
`REQUEST_SECONDS` to send one request of at most `MAX_REQUEST_BYTES`, one request each."""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import Callable
from functools import partial
from importlib import resources

import h11
import trio

from peer.errors import UserError
from peer.logs import finite

log = logging.getLogger("peertrain.dashboard")

MAX_CONNECTIONS = 32
REQUEST_SECONDS = 10.0
MAX_REQUEST_BYTES = 8192


def asset(name: str) -> bytes:
    return resources.files("peer.dashboard").joinpath(name).read_bytes()


#: Path -> (file, content type): the whole site.
ASSETS = {
    b"/": ("page.html", b"text/html; charset=utf-8"),
    b"/index.html": ("page.html", b"text/html; charset=utf-8"),
    b"/app.js": ("page.js", b"text/javascript; charset=utf-8"),
}


async def serve_dashboard(
    host: str,
    port: int,
    state: Callable[[], dict],
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the page and `state()` (as JSON) on (host, port); reports the bound port."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as error:
        why = "in use" if error.errno == errno.EADDRINUSE else error.strerror
        raise UserError(
            f"dashboard {host}:{port}: {why}; pick another dashboard.port (0 turns it off)"
        ) from None
    slots = trio.CapacityLimiter(MAX_CONNECTIONS)
    bound = listeners[0].socket.getsockname()[1]
    log.info("dashboard at http://%s:%d/", host if ":" not in host else f"[{host}]", bound)
    task_status.started(bound)
    await trio.serve_listeners(partial(_connection, state=state, slots=slots), listeners)


async def _connection(
    stream: trio.SocketStream, *, state: Callable[[], dict], slots: trio.CapacityLimiter
) -> None:
    async with stream:
        try:
            slots.acquire_nowait()
        except trio.WouldBlock:
            return  # too many at once: closed unanswered
        try:
            with trio.move_on_after(REQUEST_SECONDS):
                await _answer(stream, state)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, h11.ProtocolError):
            pass  # the client's fault or its departure: nothing of ours to report
        finally:
            slots.release()


async def _answer(stream: trio.SocketStream, state: Callable[[], dict]) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
    request = None
    while request is None:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(MAX_REQUEST_BYTES)
            if not data:
                return
            conn.receive_data(data)
        elif isinstance(event, h11.Request):
            request = event
        else:
            return
    if request.method != b"GET":
        status, kind, body = 405, b"text/plain", b"only GET\n"
    elif request.target in ASSETS:
        name, kind = ASSETS[request.target]
        status, body = 200, asset(name)
    elif request.target == b"/api/state":
        document = json.dumps(finite(state()), allow_nan=False, separators=(",", ":"))
        status, kind, body = 200, b"application/json", document.encode()
    else:
        status, kind, body = 404, b"text/plain", b"not found\n"
    headers = [
        (b"content-type", kind),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        (b"connection", b"close"),
        # The page runs its own script only, and fetches from this server alone.
        (
            b"content-security-policy",
            b"default-src 'self'; script-src 'unsafe-inline' 'self'; style-src 'unsafe-inline'",
        ),
        (b"x-content-type-options", b"nosniff"),
    ]
    for event in (
        h11.Response(status_code=status, headers=headers),
        h11.Data(data=body),
        h11.EndOfMessage(),
    ):
        await stream.send_all(conn.send(event))


__all__ = ["ASSETS", "asset", "serve_dashboard"]
