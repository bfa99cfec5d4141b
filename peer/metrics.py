"""Prometheus metrics of one daemon, read when Prometheus scrapes (`metrics.port`).

Nothing in the training loop or the DHT calls into this module: they keep plain counters
(`TrainerStatus`, `DHT.statistics()`, `Measurements`) and the collector reads them at scrape
time. Each daemon has its own registry, so several daemons in one process (tests) never collide.
The endpoint is a small HTTP/1.0 server on trio, owned by the daemon's nursery: GET /metrics
only, one request per connection, a deadline on every read and a cap on the request's size,
and bounded connections (`LIMITS`, see `peer.net.slots`): a network prefix over its accept
rate is closed at accept, at most `max_total` at once and `max_per_prefix` from one prefix (a
newcomer past it takes its prefix's oldest).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from peer.errors import UserError
from peer.net.admission import peer_address, serve_listeners
from peer.net.slots import ListenerLimits, Slots

if TYPE_CHECKING:  # the trainer imports torch; a backbone never needs it
    from peer.dht.node import DHT
    from peer.loopwatch import LoopWatch
    from peer.measure.service import Measurements
    from peer.training.trainer import Trainer

log = logging.getLogger("peertrain.metrics")

PREFIX = "peertrain"
REQUEST_TIMEOUT = 5.0
MAX_REQUEST_BYTES = 8192
FAILURE_KINDS = ("averaging_incomplete", "state_download")
#: A Prometheus scrapes every 15 s or so, from one address; a few of them at most.
LIMITS = ListenerLimits(max_total=16, max_per_prefix=4, accept_rate=5.0, accept_burst=10)


@dataclass
class Sources:
    """What one daemon's metrics are read from."""

    role: str
    peer_id: str
    version: str
    dht: DHT
    measurements: Measurements | None = None
    trainers: list[Trainer] = field(default_factory=list)
    """Appended to when training starts (a backbone has none)."""
    loop: LoopWatch | None = None
    """The daemon's event-loop lag monitor."""

    def add_trainer(self, trainer: Trainer) -> Trainer:
        self.trainers.append(trainer)
        return trainer


class DaemonCollector(Collector):
    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        s = self.sources
        info = InfoMetricFamily(PREFIX, "This daemon: role, peer id and version.")
        info.add_metric([], {"role": s.role, "peer_id": s.peer_id, "version": s.version})
        yield info
        yield from self._dht()
        yield from self._measurements()
        yield from self._loop()
        if s.trainers:
            yield from self._training(s.trainers[0])

    def _dht(self) -> Iterator[Metric]:
        stats = self.sources.dht.statistics()
        yield GaugeMetricFamily(
            f"{PREFIX}_peers_seen", "DHT contacts in the routing table.", value=stats.contacts
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_dht_keys", "DHT keys this node holds.", value=stats.keys_held
        )
        calls = CounterMetricFamily(
            f"{PREFIX}_dht_operations",
            "DHT RPCs this node made, by method and outcome (ok, timeout, unreachable, error).",
            labels=["method", "outcome"],
        )
        for (method, outcome), n in sorted(stats.calls.items()):
            calls.add_metric([method, outcome], n)
        yield calls
        served = CounterMetricFamily(
            f"{PREFIX}_dht_requests_served", "DHT requests served, by kind.", labels=["kind"]
        )
        served.add_metric(["store"], stats.stores_received)
        served.add_metric(["get"], stats.gets_served)
        yield served

    def _measurements(self) -> Iterator[Metric]:
        m = self.sources.measurements
        capabilities = m.capabilities() if m is not None else None
        if capabilities is None:
            return
        yield GaugeMetricFamily(
            f"{PREFIX}_measured_samples_per_second",
            "Measured compute speed of this peer.",
            value=capabilities.samples_per_s,
        )
        link = GaugeMetricFamily(
            f"{PREFIX}_measured_bandwidth_bytes_per_second",
            "Measured link speed, by direction.",
            labels=["direction"],
        )
        link.add_metric(["upload"], capabilities.upload_bps)
        link.add_metric(["download"], capabilities.download_bps)
        yield link
        yield GaugeMetricFamily(
            f"{PREFIX}_reachable",
            "1 if backbones could dial this node back, else 0 (client-only).",
            value=float(capabilities.reachable),
        )

    def _loop(self) -> Iterator[Metric]:
        if self.sources.loop is None:
            return
        stats = self.sources.loop.statistics()
        yield GaugeMetricFamily(
            f"{PREFIX}_event_loop_longest_stall_seconds",
            "Longest time the event loop ran no task (a wake-up's lateness), since start.",
            value=stats.longest_stall,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_event_loop_stalls",
            f"Event-loop stalls over {stats.threshold * 1000:g} ms since start.",
            value=stats.stalls_over_threshold,
        )

    def _training(self, trainer: Trainer) -> Iterator[Metric]:
        status = trainer.status()
        view = status.view
        yield CounterMetricFamily(
            f"{PREFIX}_steps", "Optimizer steps this peer applied.", value=status.steps_applied
        )
        yield GaugeMetricFamily(f"{PREFIX}_step", "Step of this peer's state.", value=status.step)
        yield GaugeMetricFamily(
            f"{PREFIX}_global_step", "Highest step any peer reports.", value=view.global_step
        )
        yield CounterMetricFamily(
            f"{PREFIX}_samples", "Samples this peer computed.", value=status.samples_computed
        )
        speed = GaugeMetricFamily(
            f"{PREFIX}_samples_per_second",
            "Training speed, of this peer and of the collaboration at its step.",
            labels=["scope"],
        )
        speed.add_metric(["peer"], status.samples_per_second)
        speed.add_metric(["collaboration"], view.throughput(status.step))
        yield speed
        loss = GaugeMetricFamily(
            f"{PREFIX}_loss",
            "Training loss (moving average) and last validation loss.",
            labels=["kind"],
        )
        if status.loss is not None:
            loss.add_metric(["training"], status.loss)
        if status.validation is not None:
            loss.add_metric(["validation"], status.validation[1])
        yield loss
        yield SummaryMetricFamily(
            f"{PREFIX}_allreduce_seconds",
            "Time spent in averaging calls.",
            count_value=status.averagings,
            sum_value=status.averaging_seconds,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_allreduce_bytes",
            "Bytes sent and received averaging.",
            value=status.averaged_bytes,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_state_downloads", "State downloads completed.", value=status.downloads
        )
        failures = CounterMetricFamily(f"{PREFIX}_failures", "Failures by kind.", labels=["kind"])
        for kind in sorted({*FAILURE_KINDS, *status.failures}):
            failures.add_metric([kind], status.failures.get(kind, 0))
        yield failures
        trainers = GaugeMetricFamily(
            f"{PREFIX}_collaboration_peers",
            "Peers in this peer's last read of the progress records, by role.",
            labels=["role"],
        )
        trainers.add_metric(["trainer"], sum(r.role == "trainer" for r in view.records))
        trainers.add_metric(["keeper"], sum(r.role == "keeper" for r in view.records))
        yield trainers


def registry_for(sources: Sources) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(sources))
    return registry


async def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    *,
    limits: ListenerLimits = LIMITS,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve GET /metrics on host:port until cancelled; started() gets the bound port."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as error:
        why = "in use" if error.errno == errno.EADDRINUSE else error.strerror
        raise UserError(
            f"metrics endpoint {host}:{port}: {why}; pick another metrics.port (0 turns it off)"
        ) from None
    bound = listeners[0].socket.getsockname()[1]
    log.info("metrics at http://%s:%d/metrics", host, bound)
    task_status.started(bound)
    slots: Slots[trio.CancelScope] = limits.slots()

    async def handle(stream: trio.SocketStream) -> None:
        scope = trio.CancelScope()  # cancelled when a newcomer takes this slot
        taken, evicted = slots.take(scope, peer_address(stream))
        for victim in evicted:
            victim.cancel()
        try:
            if taken:
                with scope:
                    await answer(stream, registry)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the scraper hung up: nothing to tell anyone
        finally:
            slots.release(scope)
            await stream.aclose()

    await serve_listeners(handle, listeners, budget=limits.budget())


async def answer(stream: trio.abc.Stream, registry: CollectorRegistry) -> None:
    """One HTTP/1.0 exchange: read the request head (bounded), send the metrics or a 404."""
    request = b""
    with trio.move_on_after(REQUEST_TIMEOUT):
        while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST_BYTES:
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            request += chunk
    words = request.split(b"\r\n", 1)[0].split()
    if len(words) >= 2 and words[0] == b"GET" and words[1].split(b"?")[0] == b"/metrics":
        status, content_type = b"200 OK", CONTENT_TYPE_LATEST.encode()
        body = generate_latest(registry)
    else:
        status, content_type, body = b"404 Not Found", b"text/plain", b"try GET /metrics\n"
    head = (
        b"HTTP/1.0 "
        + status
        + b"\r\nContent-Type: "
        + content_type
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n"
    )
    with trio.move_on_after(REQUEST_TIMEOUT):
        await stream.send_all(head + body)
