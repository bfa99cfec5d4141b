"""The web dashboard (`peer.dashboard`): what it draws from status reports, and its server."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import suppress

import pytest
import trio

from peer.dashboard.history import History
from peer.dashboard.server import LIMITS, REQUEST_SECONDS, encode, serve_dashboard
from peer.errors import UserError
from peer.status import CollaborationSummary, StatusReport, TrainingSummary
from tests.collab_processes import BASE_ENV, ROOT, Collaboration
from tests.test_api import free_port

TIMEOUT = 20


def report(step: int, trend: list[float], *, at: float, peers: int = 3, validation=None):
    training = TrainingSummary(
        global_step=step, trainers=peers, trainers_behind=0, keepers=0, samples=0,
        target_batch=None, samples_per_s=100.0 * step, eta_s=None,
        loss=trend[-1] if trend else None, loss_trend=trend, validation=validation,
        validation_trend=[], bytes_per_step=0,
    )  # fmt: skip
    summary = CollaborationSummary(
        name="demo", peers_online=peers, backbones_online=1, backbones_reached=[],
        queried_at=at, assignment=None, assignment_note=None, training=training,
    )  # fmt: skip
    return StatusReport(summary, [])


def test_every_step_gets_its_point_also_between_two_reads():
    history = History()
    history.add(report(5, [2.0, 1.9, 1.8], at=100.0))
    history.add(report(8, [1.7, 1.6, 1.5], at=110.0, validation=(8, 1.55)))
    history.add(report(8, [1.7, 1.6, float("nan")], at=120.0))  # a NaN is no point
    state = history.to_json()
    assert state["loss"] == [(3, 2.0), (4, 1.9), (5, 1.8), (6, 1.7), (7, 1.6), (8, 1.5)]
    assert state["validation"] == [(8, 1.55)]
    assert state["throughput"] == [(100.0, 500.0), (110.0, 800.0), (120.0, 800.0)]
    assert state["peers_online"] == [(100.0, 3), (110.0, 3), (120.0, 3)]
    assert state["collaboration"]["training"]["global_step"] == 8


def test_the_history_is_bounded():
    history = History(max_points=4)
    for step in range(1, 20):
        history.add(report(step, [1.0 / step], at=float(step)))
    state = history.to_json()
    assert [s for s, _ in state["loss"]] == [16, 17, 18, 19]
    assert len(state["throughput"]) == len(state["peers_online"]) == 4


async def get(port: int, request: bytes, *, source: str | None = None) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
    async with stream:
        await stream.send_all(request)
        reply = b""
        try:
            while chunk := await stream.receive_some(65536):
                reply += chunk
        except trio.BrokenResourceError:  # closed with our request unread: a reset
            pass
        return reply


def body_of(reply: bytes) -> bytes:
    return reply.split(b"\r\n\r\n", 1)[1]


async def test_the_server_serves_the_page_and_finite_json_and_nothing_else():
    state = {"loss": [[1, 2.5], [2, math.nan]], "x": math.inf}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_dashboard, "127.0.0.1", 0, lambda: encode(state))
            page = await get(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert page.startswith(b"HTTP/1.1 200") and b'id="loss-chart"' in page
            assert b"content-security-policy" in page.lower()
            script = await get(port, b"GET /app.js HTTP/1.1\r\nHost: x\r\n\r\n")
            assert script.startswith(b"HTTP/1.1 200") and b"textContent" in script
            data = await get(port, b"GET /api/state HTTP/1.1\r\nHost: x\r\n\r\n")
            assert json.loads(body_of(data)) == {"loss": [[1, 2.5], [2, None]], "x": None}
            assert b"script-src 'self';" in page and b"unsafe-inline'; img" in page
            post = await get(
                port, b"POST /api/state HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
            )
            assert post.startswith(b"HTTP/1.1 405")
            missing = await get(port, b"GET /etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n")
            assert missing.startswith(b"HTTP/1.1 404")
            assert await get(port, b"\x00garbage\r\n\r\n") == b""  # closed, nothing more
            huge = b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
            assert not (await get(port, huge)).startswith(b"HTTP/1.1 200")
            nursery.cancel_scope.cancel()


async def test_idle_connections_past_a_prefixs_share_or_every_slot_make_room_for_newcomers(
    autojump_clock,
):
    async def idle(address: str) -> trio.SocketStream:
        return await trio.open_tcp_stream("127.0.0.1", port, local_address=address)

    async def closed_at_once(stream: trio.SocketStream) -> bool:
        """The server closes `stream` unanswered at once (well before REQUEST_SECONDS)."""
        with trio.move_on_after(1) as waited:
            assert await stream.receive_some(10) == b""
        return not waited.cancelled_caught

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_dashboard, "127.0.0.1", 0, lambda: b"{}")
            per, prefixes = LIMITS.max_per_prefix, LIMITS.max_total // LIMITS.max_per_prefix
            # One /24 holds max_per_prefix slots: its next connection takes its oldest's.
            held = [await idle(f"127.0.0.{2 + n % 5}") for n in range(per)]
            newest = await idle("127.0.0.9")
            assert await closed_at_once(held[0])
            held = [*held[1:], newest]
            # Every slot held: a request from a /24 holding fewer takes the busiest's oldest.
            for prefix in range(1, prefixes):
                held += [await idle(f"127.0.{prefix}.1") for _ in range(per)]
            reply = await get(
                port, b"GET /api/state HTTP/1.1\r\nHost: x\r\n\r\n", source="127.0.99.1"
            )
            assert reply.startswith(b"HTTP/1.1 200")
            assert await closed_at_once(held[0])
            await trio.sleep(REQUEST_SECONDS + 1)  # the idle ones time out and free theirs
            for stream in held:
                await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_an_idle_flood_from_one_slash_24_leaves_other_clients_answered():
    """Issue 45: 5 addresses of one /24 x 8 idle connections each, reopened as soon as
    closed, left 1 of 77 requests from elsewhere answered (slots keyed on the exact address,
    no eviction: the flood held all 32). That /24 now holds 8 slots at most, its surplus is
    closed at accept or takes its own oldest, and every request from another /24 is answered."""
    opened = 0

    async def hold(address: str) -> None:
        """One idle connection from `address` at all times: reopened as soon as closed."""
        nonlocal opened
        while True:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=address)
            except OSError:
                await trio.sleep(0)
                continue
            opened += 1
            async with stream:
                with suppress(trio.BrokenResourceError):
                    while await stream.receive_some(1024):
                        pass

    request = b"GET /api/state HTTP/1.1\r\nHost: x\r\n\r\n"
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_dashboard, "127.0.0.1", 0, lambda: b"{}")
            for n in range(2, 7):
                for _ in range(8):
                    nursery.start_soon(hold, f"127.0.0.{n}")
            while opened < 80:  # every one open, and many reopened
                await trio.sleep(0.01)
            replies = [await get(port, request, source="127.0.9.1") for _ in range(20)]
            nursery.cancel_scope.cancel()
    answered = sum(reply.startswith(b"HTTP/1.1 200") for reply in replies)
    assert answered == len(replies), f"{answered} of {len(replies)} answered"


async def test_a_port_in_use_is_a_one_line_error():
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_dashboard, "127.0.0.1", 0, lambda: b"{}")
            with pytest.raises(UserError, match=r"in use; pick another dashboard\.port"):
                await serve_dashboard("127.0.0.1", port, dict)
            nursery.cancel_scope.cancel()


def test_peer_status_serve_shows_the_collaboration_from_any_machine(tmp_path):
    """`peer status --serve PORT`: the dashboard through a status client (here beside a
    backbone process on loopback), until Ctrl+C."""
    collab = Collaboration(tmp_path, {})
    port = free_port()
    status = None
    try:
        collab.start_backbone()
        status = subprocess.Popen(
            [sys.executable, "-m", "cli.peer_cli", "status", "--backbone", collab.backbone_addr,
             "--serve", str(port), "--interval", "0.5"],
            cwd=ROOT, env={**os.environ, **BASE_ENV},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline, state = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=5) as r:
                    state = json.load(r)
                if state["peers"]:
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        assert state is not None and [p["role"] for p in state["peers"]] == ["backbone"], state
        status.send_signal(signal.SIGINT)
        output, _ = status.communicate(timeout=30)
        assert status.returncode == 0, output
        assert f"dashboard at http://127.0.0.1:{port}/" in output
    finally:
        if status is not None and status.poll() is None:
            status.kill()
            status.wait(10)
        collab.close()
