"""The dashboard's web server: one page (`page.html` and its script `page.js`, no external
assets) and its data as JSON
(`/api/state`), over HTTP/1.1 parsed by h11 on trio. Read-only, and it serves only what the
collaboration's public records say; it listens on 127.0.0.1 unless told otherwise.

Every connection is bounded: at most `MAX_CONNECTIONS` at once and `PER_ADDRESS` from one
address (more are closed unanswered), `REQUEST_SECONDS` to send one request of at most
`MAX_REQUEST_BYTES`, one request each; the state is encoded once per read of the records, not
per request."""

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
#: Connections at once from one address: one client cannot hold every slot.
PER_ADDRESS = 8
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
    slots = _Slots()
    bound = listeners[0].socket.getsockname()[1]
    log.info("dashboard at http://%s:%d/", host if ":" not in host else f"[{host}]", bound)
    task_status.started(bound)
    await trio.serve_listeners(partial(_connection, document=document, slots=slots), listeners)


class _Slots:
    """At most MAX_CONNECTIONS connections in all and PER_ADDRESS from one address."""

    def __init__(self) -> None:
        self.total = 0
        self.by_address: dict[str, int] = {}

    def take(self, address: str) -> bool:
        if self.total >= MAX_CONNECTIONS or self.by_address.get(address, 0) >= PER_ADDRESS:
            return False
        self.total += 1
        self.by_address[address] = self.by_address.get(address, 0) + 1
        return True

    def give_back(self, address: str) -> None:
        self.total -= 1
        self.by_address[address] -= 1
        if not self.by_address[address]:
            del self.by_address[address]


async def _connection(
    stream: trio.SocketStream, *, document: Callable[[], bytes], slots: _Slots
) -> None:
    async with stream:
        try:
            address = str(stream.socket.getpeername()[0])
        except OSError:
            return
        if not slots.take(address):
            return  # too many at once: closed unanswered
        try:
            with trio.move_on_after(REQUEST_SECONDS):
                await _answer(stream, document)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, h11.ProtocolError):
            pass  # the client's fault or its departure: nothing of ours to report
        except Exception:  # ours: logged, and the daemon that serves us goes on
            log.exception("dashboard request failed")
        finally:
            slots.give_back(address)


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


__all__ = ["ASSETS", "asset", "encode", "serve_dashboard"]
