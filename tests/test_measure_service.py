"""What a node advertises from its measurements, and how real work refines them (pure parts)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import pytest
import trio

from peer.config import PeerConfig
from peer.errors import NoBackbone, NotABackbone, Unreachable
from peer.measure.compute import ComputeMeasurement
from peer.measure.ema import RateEMA
from peer.measure.probe import LinkMeasurement
from peer.measure.reachability import BUSY, DialBackResult
from peer.measure.service import (
    NO_BACKBONE_MEASUREMENTS,
    TRAINED_MICRO_BATCHES,
    TRAINED_WAIT,
    TRAINING_WAIT,
    Measurements,
    best_link,
    reachability_verdict,
)
from peer.priority import NICENESS


def test_rate_ema_weights_by_time_not_by_count():
    ema = RateEMA(100.0, half_life=10.0)
    assert ema.observe(2000, 10.0) == pytest.approx(0.5 * 100 + 0.5 * 200)
    assert ema.observe(0, 0.0) == pytest.approx(150.0)  # nothing observed: unchanged
    split = RateEMA(100.0, half_life=10.0)
    for _ in range(10):
        split.observe(200, 1.0)
    assert split.value == pytest.approx(150.0)  # ten 1 s observations = one 10 s observation
    ema.observe(300 * 1000, 1000.0)
    assert ema.value == pytest.approx(300.0)  # long runs forget the start


def test_best_link_takes_the_fastest_directions_and_the_shortest_rtt():
    links = [LinkMeasurement(1e6, 5e6, 0.040), LinkMeasurement(2e6, 3e6, 0.080)]
    assert best_link(links) == LinkMeasurement(2e6, 5e6, 0.040)
    assert best_link([]) is None


async def no_backbones() -> list:
    return []


def measured_peer() -> Measurements:
    node = SimpleNamespace(peer_id="me")
    m = Measurements(node, PeerConfig(), find_backbones=no_backbones)  # type: ignore[arg-type]
    m.compute = ComputeMeasurement(100.0, "cpu", 1 << 30, 4000)
    m.speed = RateEMA(100.0, half_life=60.0)
    m.link = LinkMeasurement(1e6, 4e6, 0.02)
    m.upload, m.download = RateEMA(1e6, half_life=300.0), RateEMA(4e6, half_life=300.0)
    return m


def test_nothing_is_advertised_before_the_first_measurement():
    node = SimpleNamespace(peer_id="me")
    m = Measurements(node, PeerConfig(), find_backbones=no_backbones)  # type: ignore[arg-type]
    assert m.capabilities() is None


def test_capabilities_carry_the_measurements_and_the_task():
    caps = measured_peer().capabilities()
    assert caps is not None
    assert (caps.samples_per_s, caps.upload_bps, caps.download_bps, caps.rtt_s) == (
        100.0,
        1e6,
        4e6,
        0.02,
    )
    assert (caps.device, caps.task, caps.gradient_bytes, caps.target_batch) == (
        "cpu",
        PeerConfig().task.name,
        4000,
        PeerConfig().task.target_batch,
    )
    assert caps.reachable is False  # until a backbone dials it back


def test_real_training_and_transfers_refine_the_figures():
    m = measured_peer()
    m.observe_training(samples=200 * 60, seconds=60.0)  # twice as fast as measured, for a half-life
    m.observe_transfer(sent=2 * 300 * 1_000_000, received=0, seconds=300.0)
    caps = m.capabilities()
    assert caps.samples_per_s == pytest.approx(150.0)
    assert caps.upload_bps == pytest.approx(1.5e6)
    assert caps.download_bps == 4e6  # nothing received: no evidence about the download


def test_only_a_definite_dial_back_answer_changes_reachability():
    assert reachability_verdict(DialBackResult(["/ip4/1.2.3.4/tcp/1"], {"a": "dial failed"}))
    assert reachability_verdict(DialBackResult([], {"a": "dial failed: refused"})) is False
    assert reachability_verdict(DialBackResult([], {"a": f"{BUSY}: too many"})) is None
    assert reachability_verdict(DialBackResult([], {})) is False  # announced nothing dialable


async def test_behind_a_nat_that_keeps_its_address_a_peer_is_punchable(monkeypatch):
    """The dial-back fails; then every backbone saw a dial from our listen port come from one
    address: the announced one (punchable), or one we do not announce that two backbones saw
    alike (punchable, and offered in hole punches). Two backbones seeing different ports (a
    symmetric NAT), or a dial-back that reaches us (reachable), make it not punchable."""
    import peer.measure.service as service

    announced = "/ip4/198.51.100.7/tcp/4001"
    seen = {"bb1": announced, "bb2": announced}
    dial_back = {"result": DialBackResult([], {announced: "dial failed: timeout"})}
    mapping_checks: list[str] = []

    async def measure_link(node, backbone, *, target_seconds):
        return LinkMeasurement(1e6, 1e6, 0.02)

    async def check_reachable(node, backbone):
        return dial_back["result"]

    async def observed_from_listen_port(node, backbone):
        mapping_checks.append(backbone)
        return seen[backbone], 4001

    async def backbones() -> list:
        return ["bb1", "bb2"]

    monkeypatch.setattr(service, "measure_link", measure_link)
    monkeypatch.setattr(service, "check_reachable", check_reachable)
    monkeypatch.setattr(service, "observed_from_listen_port", observed_from_listen_port)
    node = SimpleNamespace(peer_id="me", announce=[announced], punch_observed=[])
    m = Measurements(node, PeerConfig(), find_backbones=backbones)  # type: ignore[arg-type]

    assert await m._measure_links()
    caps = m.capabilities()
    assert m.verdict is False and caps is not None and caps.punchable and not caps.reachable
    assert mapping_checks == ["bb1", "bb2"] and node.punch_observed == []  # announced already

    outside = "/ip4/198.51.100.7/tcp/61234"  # not announced, another port, seen by both
    seen.update(bb1=outside, bb2=outside)
    assert await m._measure_links()
    assert m.capabilities().punchable and node.punch_observed == [outside]  # type: ignore[union-attr]

    seen["bb2"] = "/ip4/198.51.100.7/tcp/61235"  # another port for another destination
    assert await m._measure_links()
    assert m.capabilities().punchable is False and node.punch_observed == []  # type: ignore[union-attr]

    dial_back["result"] = DialBackResult([announced], {})
    mapping_checks.clear()
    assert await m._measure_links()
    caps = m.capabilities()
    assert caps is not None and caps.reachable and not caps.punchable
    assert mapping_checks == []  # reachable: nothing to punch


async def test_a_peer_whose_every_backbone_is_a_peer_stops_with_one_line(monkeypatch):
    """Every backbone we know answering as a peer (`NotABackbone`) for
    NO_BACKBONE_MEASUREMENTS measurements in a row stops a peer with a `NoBackbone` that says
    what to do. One real backbone among them, a backbone we merely cannot reach or measured
    before, or a node that is itself a backbone never does."""
    import peer.measure.service as service

    answers: dict[str, type[Exception] | None] = {"p1": NotABackbone, "p2": NotABackbone}

    async def measure_link(node, backbone, *, target_seconds):
        if (error := answers[backbone]) is not None:
            raise error(f"{backbone} answered")
        return LinkMeasurement(1e6, 1e6, 0.02)

    async def check_reachable(node, backbone):
        return DialBackResult(["/ip4/198.51.100.7/tcp/4001"], {})

    async def backbones() -> list:
        return list(answers)

    monkeypatch.setattr(service, "measure_link", measure_link)
    monkeypatch.setattr(service, "check_reachable", check_reachable)
    node = SimpleNamespace(peer_id="me", announce=[], punch_observed=[])

    def measurements(probe_server=None) -> Measurements:
        return Measurements(node, PeerConfig(), find_backbones=backbones, probe_server=probe_server)  # type: ignore[arg-type]

    m = measurements()
    for _ in range(NO_BACKBONE_MEASUREMENTS - 1):
        assert not await m._measure_links()
    with pytest.raises(
        NoBackbone, match=r"no backbone in this collaboration \(p1, p2: a peer.*backbone start"
    ):
        await m._measure_links()

    m = measurements()
    answers["p2"] = None  # a real backbone found in presence beside the peer we were given
    for _ in range(2 * NO_BACKBONE_MEASUREMENTS):
        assert await m._measure_links()

    answers["p2"] = Unreachable  # gone for now: no definite answer, so no verdict either
    for _ in range(2 * NO_BACKBONE_MEASUREMENTS):
        assert not await m._measure_links()

    # p2 was our backbone, found in presence beside p1 (a peer we joined through); it
    # restarts and withdraws its record: we measured it once, so we wait for it.
    del answers["p2"]
    for _ in range(2 * NO_BACKBONE_MEASUREMENTS):
        assert not await m._measure_links()

    answers["p2"] = NotABackbone
    m = measurements(probe_server=object())  # a backbone: it needs no other to train
    for _ in range(2 * NO_BACKBONE_MEASUREMENTS):
        assert not await m._measure_links()

    lookups = iter([True, False, True])  # a failed lookup between two: not two in a row

    async def flaky() -> list:
        if next(lookups):
            return list(answers)
        raise Unreachable("no replica answered")

    m = Measurements(node, PeerConfig(), find_backbones=flaky)  # type: ignore[arg-type]
    for _ in range(3):
        assert not await m._measure_links()


def test_capabilities_carry_the_newest_attestation_of_each_backbone():
    from peer.measure.attestation import MAX_ATTESTATIONS
    from tests.helpers import new_identity
    from tests.test_group import attested

    m = measured_peer()
    backbones = [new_identity() for _ in range(MAX_ATTESTATIONS + 1)]
    first, second = backbones[0], backbones[1]
    m.keep_attestations([attested("me", 1e6, signer=first, issued_at=100.0), None])
    m.keep_attestations([attested("me", 2e6, signer=first, issued_at=200.0)])  # replaces it
    m.keep_attestations([attested("me", 3e6, signer=second, issued_at=150.0)])
    caps = m.capabilities()
    assert caps is not None
    assert {(a.signer, a.upload_bps) for a in caps.attestations} == {
        (first.peer_id.to_base58(), 2e6),
        (second.peer_id.to_base58(), 3e6),
    }
    # At most MAX_ATTESTATIONS, the newest: the oldest backbone's falls out.
    m.keep_attestations(
        attested("me", 1e6, signer=b, issued_at=300.0 + i) for i, b in enumerate(backbones[2:])
    )
    kept = {a.signer for a in m.capabilities().attestations}
    assert len(kept) == MAX_ATTESTATIONS and first.peer_id.to_base58() in kept
    assert second.peer_id.to_base58() not in kept


def test_a_backbone_signs_what_its_probes_showed_of_its_own_link():
    """With one backbone nobody else measures it: unattested it counted at the floor and the
    shares LP never gave it anything to aggregate. It signs its own figures (re-signed when
    they move), and a reader that trusts it takes them."""
    import time

    from peer.measure.attestation import Evidence, attested_link
    from tests.helpers import new_identity

    identity = new_identity()
    me = identity.peer_id.to_base58()
    key = identity.key_pair.private_key
    node = SimpleNamespace(
        peer_id=identity.peer_id, host=SimpleNamespace(get_private_key=lambda: key)
    )
    served = {"rates": (0.0, 0.0)}
    server = SimpleNamespace(capacity=lambda now: served["rates"])
    m = Measurements(node, PeerConfig(), find_backbones=no_backbones, probe_server=server)  # type: ignore[arg-type]

    def evidence(trusted: set[str]) -> Evidence:
        return Evidence(trusted=frozenset(trusted), at=time.time(), max_age=3600, floor=1e6)

    served["rates"] = (5e8, 4e8)
    caps = m.capabilities()
    assert caps is not None
    assert attested_link(me, caps.attestations, evidence({me})) == (5e8, 4e8)
    assert attested_link(me, caps.attestations, evidence({"someone-else"})) is None
    served["rates"] = (5.2e8, 4e8)  # within a tenth: the same attestation
    assert m.capabilities().attestations == caps.attestations
    served["rates"] = (9e8, 4e8)
    assert attested_link(me, m.capabilities().attestations, evidence({me})) == (9e8, 4e8)


class Benchmarked(list):
    """measure_compute replaced by a record of its calls: (task name, thread, nice level)."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        import peer.measure.compute as compute_module

        def measure_compute(task, **options) -> ComputeMeasurement:
            thread = threading.get_native_id()
            self.append((task.name, thread, os.getpriority(os.PRIO_PROCESS, thread)))
            return ComputeMeasurement(10.0, "cpu", 1 << 30, 4000)

        monkeypatch.setattr(compute_module, "measure_compute", measure_compute)

    def tasks(self) -> list[str]:
        return [name for name, _, _ in self]


def peer_measurements(*, workload: bool = True) -> Measurements:
    node = SimpleNamespace(peer_id="me")
    work = (SimpleNamespace(name="t"), "cpu") if workload else None
    return Measurements(node, PeerConfig(), find_backbones=no_backbones, workload=work)  # type: ignore[arg-type]


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice levels are Linux's")
def test_the_compute_benchmark_runs_below_the_event_loop_in_a_thread_of_its_own(monkeypatch):
    """At the event loop's priority, a late joiner's benchmark took cores from its own state
    download; in trio's thread pool, a lowered priority would stick to a thread others reuse."""
    calls = Benchmarked(monkeypatch)
    m = peer_measurements()

    async def main() -> int:
        await m._measure_compute(SimpleNamespace(name="t"), "cpu")  # type: ignore[arg-type]
        return await trio.to_thread.run_sync(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        )

    pooled = trio.run(main)
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert [nice for _, _, nice in calls] == [min(19, ours + NICENESS)]
    assert calls[0][1] != threading.get_native_id() and pooled == ours
    assert m.compute is not None and m.compute.samples_per_s == 10.0


async def measured(m: Measurements) -> None:
    """Until the benchmark (in a thread: a deadline on the virtual clock would jump past it)
    is done; a bounded number of polls."""
    for _ in range(100_000):
        if m.compute is not None:
            return
        await trio.sleep(0.01)
    raise AssertionError("never measured")


async def test_a_peer_benchmarks_its_compute_once_training_computes(monkeypatch, autojump_clock):
    """A late joiner's benchmark ran beside its state download and load (0.8 GB of model and
    gradients, and cores, at 100 M): it waits for the first micro-batch of training."""
    calls = Benchmarked(monkeypatch)
    m = peer_measurements()
    async with trio.open_nursery() as nursery:
        await nursery.start(m.run)
        await trio.sleep(TRAINING_WAIT / 2)  # downloading the state
        assert calls.tasks() == [] and m.capabilities() is None
        m.observe_training(4, 1.0)  # the first micro-batch
        await m.wait_changed()  # no timer left to jump to: the clock stays while it runs
        nursery.cancel_scope.cancel()
    assert calls.tasks() == ["t"] and m.compute is not None
    assert trio.current_time() < TRAINING_WAIT


@asynccontextmanager
async def training(monkeypatch) -> AsyncIterator[tuple[Benchmarked, Measurements]]:
    """A trainer's measurements running, its model named and its first micro-batch (torch's
    warm-up, not counted) done; stopped on exit, once it measured its compute."""
    calls = Benchmarked(monkeypatch)
    m = peer_measurements()
    m.observe_model(gradient_bytes=4000)
    async with trio.open_nursery() as nursery:
        await nursery.start(m.run)
        m.observe_training(4, 30.0)  # warm-up: not counted
        yield calls, m
        await m.wait_changed()
        nursery.cancel_scope.cancel()


async def test_a_trainer_s_compute_is_measured_from_its_own_micro_batches(
    monkeypatch, autojump_clock
):
    """The benchmark's model and gradients (0.8 GB at 100 M) came on top of a late joiner's
    optimizer state: its peak. A peer that names its model measures its real micro-batches
    instead, after the first (torch's warm-up), TRAINED_MICRO_BATCHES of them and at least
    `measure.compute_seconds` (1 s)."""
    async with training(monkeypatch) as (calls, m):
        for _ in range(TRAINED_MICRO_BATCHES):
            await trio.sleep(1)
            assert m.compute is None
            m.observe_training(4, 0.5)
    assert calls.tasks() == []  # no benchmark
    assert m.compute is not None and m.compute.samples_per_s == pytest.approx(8.0)
    assert m.compute.gradient_bytes == 4000
    assert trio.current_time() < TRAINING_WAIT


async def test_a_trainer_with_short_micro_batches_is_measured_from_them_after_a_while(
    monkeypatch, autojump_clock
):
    """A trainer whose share of each step is small spends most of it averaging: it added up
    `measure.compute_seconds` of micro-batches in 60 s of the tiny task's 3 s steps, and its
    links, measured after its compute, were unknown all that time (CI: status showed it
    client-only "?" after 90 s). After TRAINED_WAIT, the micro-batches it has count."""
    async with training(monkeypatch) as (calls, m):
        for _ in range(TRAINED_MICRO_BATCHES):
            m.observe_training(2, 0.01)  # 0.03 s in all, far below compute_seconds
        await trio.sleep(TRAINED_WAIT - 1)
        assert m.compute is None
    assert calls.tasks() == []  # measured from training, no benchmark
    assert m.compute is not None and m.compute.samples_per_s == pytest.approx(200.0)
    assert TRAINED_WAIT <= trio.current_time() < TRAINING_WAIT


async def test_a_peer_that_never_trains_is_measured_after_a_while(monkeypatch, autojump_clock):
    calls = Benchmarked(monkeypatch)
    m = peer_measurements()
    async with trio.open_nursery() as nursery:
        await nursery.start(m.run)
        await trio.sleep(TRAINING_WAIT - 1)
        assert calls.tasks() == []
        await trio.sleep(2)
        await measured(m)
        nursery.cancel_scope.cancel()
    assert calls.tasks() == ["t"]


async def test_the_compute_benchmark_gives_its_freed_memory_back(monkeypatch):
    """It runs after the trainer has allocated its state now: its model and gradients, freed,
    stayed in glibc's heap (0.46 GB at 100 M) on top of the trainer's peak."""
    import peer.measure.service as service

    Benchmarked(monkeypatch)
    returned: list[int] = []
    monkeypatch.setattr(service, "return_free_memory", lambda: returned.append(1))
    m = peer_measurements(workload=False)
    await m._measure_compute(SimpleNamespace(name="t"), "cpu")  # type: ignore[arg-type]
    assert returned == [1] and m.compute is not None
