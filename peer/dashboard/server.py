"""The dashboard's web server: one page (`page.html` and its script `page.js`, no external
assets) and its data as JSON
(`/api/state`), over HTTP/1.1 parsed by h11 on trio. Read-only, and it serves only what the
collaboration's public records say; it listens on 127.0.0.1 unless told otherwise.

Every connection is bounded (`LIMITS`, see `peer.net.slots`): a network prefix (IPv4 /24,
IPv6 /64) over its accept rate is closed at accept; at most `max_total` at once and
`max_per_prefix` from one prefix (a newcomer past it takes its prefix's oldest, so clients
sharing an address with an idle flood are still answered); `REQUEST_SECONDS` to send one
request of at most `MAX_REQUEST_BYTES`, one request each; the state is encoded once per read
of the records, not per request."""

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
from peer.net.admission import peer_address, serve_listeners
from peer.net.slots import ListenerLimits, Slots

log = logging.getLogger("peertrain.dashboard")

#: A browser polls /api/state every few seconds over a new connection (one request each).
LIMITS = ListenerLimits(max_total=32, max_per_prefix=8, accept_rate=20.0, accept_burst=40)
#: To send the request: a slow client holds its slot no longer than this.
REQUEST_SECONDS = 3.0
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
    document: Callable[[], bytes],
    *,
    limits: ListenerLimits = LIMITS,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the page and `document()` (the JSON state, encoded once per change by its
    owner: a request costs no encoding) on (host, port); reports the bound port."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as error:
        why = "in use" if error.errno == errno.EADDRINUSE else error.strerror
        raise UserError(
            f"dashboard {host}:{port}: {why}; pick another dashboard.port (0 turns it off)"
        ) from None
    slots: Slots[trio.CancelScope] = limits.slots()
    bound = listeners[0].socket.getsockname()[1]
    log.info("dashboard at http://%s:%d/", host if ":" not in host else f"[{host}]", bound)
    task_status.started(bound)
    handler = partial(_connection, document=document, slots=slots)
    await serve_listeners(handler, listeners, budget=limits.budget())


async def _connection(
    stream: trio.SocketStream, *, document: Callable[[], bytes], slots: Slots[trio.CancelScope]
) -> None:
    async with stream:
        # The request's deadline; cancelled too when a newcomer takes this slot.
        scope = trio.CancelScope(deadline=trio.current_time() + REQUEST_SECONDS)
        taken, evicted = slots.take(scope, peer_address(stream))
        for victim in evicted:
            victim.cancel()
        if not taken:
            return  # every slot held, none to take: closed unanswered
        try:
            with scope:
                await _answer(stream, document)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, h11.ProtocolError):
            pass  # the client's fault or its departure: nothing of ours to report
        except Exception:  # ours: logged, and the daemon that serves us goes on
            log.exception("dashboard request failed")
        finally:
            slots.release(scope)


#: The page may run its own script file and fetch from this server, nothing else.
POLICY = (
    b"default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'unsafe-inline'; "
    b"img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


async def _answer(stream: trio.SocketStream, document: Callable[[], bytes]) -> None:
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
        status, kind, body = 200, b"application/json", document()
    else:
        status, kind, body = 404, b"text/plain", b"not found\n"
    headers = [
        (b"content-type", kind),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        (b"connection", b"close"),
        (b"content-security-policy", POLICY),
        (b"x-content-type-options", b"nosniff"),
    ]
    for event in (
        h11.Response(status_code=status, headers=headers),
        h11.Data(data=body),
        h11.EndOfMessage(),
    ):
        await stream.send_all(conn.send(event))


def encode(state: dict) -> bytes:
    """`state` as JSON, non-finite numbers as null (JSON has none)."""
    return json.dumps(finite(state), allow_nan=False, separators=(",", ":")).encode()


__all__ = ["ASSETS", "LIMITS", "asset", "encode", "serve_dashboard"]
