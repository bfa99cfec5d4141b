"""Prometheus metrics: what the collector reads from a daemon's parts, and the endpoint."""

from __future__ import annotations

import socket
from collections import Counter
from types import SimpleNamespace

import pytest
import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import peer.metrics as metrics
from peer.dht.node import DhtStatistics
from peer.errors import UserError
from peer.training.progress import CollaborationView
from peer.training.trainer import TrainerStatus
from tests.test_progress import rec


def samples(registry) -> dict[tuple[str, tuple], float]:
    """name + sorted labels -> value, from the exposition text as Prometheus would parse it."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def fake_dht(calls=None):
    stats = DhtStatistics(7, 3, 11, 13, calls or {("get", "ok"): 5, ("store", "timeout"): 2})
    return SimpleNamespace(statistics=lambda: stats)


def test_a_backbone_exposes_identity_and_dht_figures_only():
    sources = metrics.Sources("backbone", "12D3KooWabc", "0.1.0", fake_dht())  # type: ignore[arg-type]
    got = samples(metrics.registry_for(sources))
    labels = (("peer_id", "12D3KooWabc"), ("role", "backbone"), ("version", "0.1.0"))
    assert got["peertrain_info", labels] == 1
    assert got["peertrain_peers_seen", ()] == 7
    assert got["peertrain_dht_operations_total", (("method", "get"), ("outcome", "ok"))] == 5
    assert got["peertrain_dht_operations_total", (("method", "store"), ("outcome", "timeout"))] == 2
    assert got["peertrain_dht_requests_served_total", (("kind", "store"),)] == 11
    assert not any(name.startswith("peertrain_step") for name, _ in got)


def test_a_trainer_exposes_steps_speed_loss_allreduce_and_failures():
    status = TrainerStatus(
        step=4,
        loss=2.5,
        samples_per_second=100.0,
        validation=(4, 2.75),
        averaged_bytes=12345,
        averaging_seconds=3.0,
        averagings=6,
        failures=Counter(state_download=2),
        steps_applied=4,
        downloads=1,
        samples_computed=640,
        view=CollaborationView(
            [rec(0, step=4, samples_per_second=60.0), rec(1, step=5), rec(2, role="keeper")]
        ),
    )
    sources = metrics.Sources("peer", "p", "0.1.0", fake_dht({}))  # type: ignore[arg-type]
    sources.add_trainer(SimpleNamespace(status=lambda: status))  # type: ignore[arg-type]
    got = samples(metrics.registry_for(sources))
    assert got["peertrain_steps_total", ()] == 4
    assert (got["peertrain_step", ()], got["peertrain_global_step", ()]) == (4, 5)
    assert got["peertrain_samples_total", ()] == 640
    assert got["peertrain_samples_per_second", (("scope", "peer"),)] == 100
    assert got["peertrain_samples_per_second", (("scope", "collaboration"),)] == 60
    assert got["peertrain_loss", (("kind", "training"),)] == 2.5
    assert got["peertrain_loss", (("kind", "validation"),)] == 2.75
    assert got["peertrain_allreduce_seconds_count", ()] == 6
    assert got["peertrain_allreduce_seconds_sum", ()] == 3.0
    assert got["peertrain_allreduce_bytes_total", ()] == 12345
    assert got["peertrain_state_downloads_total", ()] == 1
    assert got["peertrain_failures_total", (("kind", "state_download"),)] == 2
    assert got["peertrain_failures_total", (("kind", "averaging_incomplete"),)] == 0
    assert got["peertrain_collaboration_peers", (("role", "trainer"),)] == 2
    assert got["peertrain_collaboration_peers", (("role", "keeper"),)] == 1


async def http(port: int, request: bytes, *, source: str | None = None) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
    async with stream:
        await stream.send_all(request)
        reply = b""
        while chunk := await stream.receive_some(65536):
            reply += chunk
    return reply


async def test_the_endpoint_serves_get_metrics_and_404s_the_rest(monkeypatch):
    monkeypatch.setattr(metrics, "REQUEST_TIMEOUT", 0.5)
    sources = metrics.Sources("backbone", "p", "0.1.0", fake_dht())  # type: ignore[arg-type]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                metrics.serve_metrics, metrics.registry_for(sources), "127.0.0.1", 0
            )
            # A scraper that never finishes its request is answered when its read times out,
            # and meanwhile another scrape is served.
            idle = await trio.open_tcp_stream("127.0.0.1", port)
            await idle.send_all(b"GET /metr")
            reply = await http(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            head, body = reply.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.0 200 OK") and b"text/plain" in head
            assert f"Content-Length: {len(body)}".encode() in head
            assert b'peertrain_info{peer_id="p",role="backbone",version="0.1.0"} 1.0' in body
            assert (await http(port, b"GET / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.0 404")
            assert (await http(port, b"\r\n\r\n")).startswith(b"HTTP/1.0 404")
            assert (await idle.receive_some(100)).startswith(b"HTTP/1.0 404")
            await idle.aclose()
            nursery.cancel_scope.cancel()


async def test_a_port_in_use_is_a_one_line_user_error():
    sources = metrics.Sources("backbone", "p", "0.1.0", fake_dht())  # type: ignore[arg-type]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=rf"127.0.0.1:{port}: in use; pick another metrics"):
            await metrics.serve_metrics(metrics.registry_for(sources), "127.0.0.1", port)


async def test_idle_connections_hold_their_prefixs_share_and_scrapes_are_still_served(
    autojump_clock,
):
    """The endpoint had no limit per source: idle connections from one address each held a
    descriptor and a task for REQUEST_TIMEOUT, as many as were opened. Now one /24 holds
    `max_per_prefix` (its newest take its oldest's slots), all prefixes `max_total`, and a
    scraper from a prefix holding fewer takes the busiest one's oldest slot."""
    sources = metrics.Sources("backbone", "p", "0.1.0", fake_dht())  # type: ignore[arg-type]
    limits = metrics.LIMITS
    per, prefixes = limits.max_per_prefix, limits.max_total // limits.max_per_prefix

    async def idle(address: str) -> trio.SocketStream:
        return await trio.open_tcp_stream("127.0.0.1", port, local_address=address)

    async def closed_at_once(stream: trio.SocketStream) -> bool:
        """The server closes `stream` at once (well before REQUEST_TIMEOUT)."""
        with trio.move_on_after(1) as waited:
            assert await stream.receive_some(100) == b""
        return not waited.cancelled_caught

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                metrics.serve_metrics, metrics.registry_for(sources), "127.0.0.1", 0
            )
            flood = [await idle(f"127.0.0.{2 + n % 5}") for n in range(per + 2)]
            assert await closed_at_once(flood[0]) and await closed_at_once(flood[1])
            held = flood[2:]
            for prefix in range(1, prefixes):
                held += [await idle(f"127.0.{prefix}.1") for _ in range(per)]
            reply = await http(port, b"GET /metrics HTTP/1.1\r\n\r\n", source="127.0.99.1")
            assert reply.startswith(b"HTTP/1.0 200 OK")
            assert await closed_at_once(held[0])
            for stream in flood + held:
                await stream.aclose()
            nursery.cancel_scope.cancel()
