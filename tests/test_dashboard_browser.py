"""The dashboard in a real browser (slow suite): Debian's headless Chromium loads a backbone's
dashboard page; its loss chart has a point for every step trained, and a peer that joins
appears in the table (the peers train on meanwhile). Skipped where there is no Chromium (`apt-get install chromium`).

`PEERTRAIN_DASHBOARD_SCREENSHOT=PATH` also saves a screenshot of the page there."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from peer.net.identity import load_or_create_identity
from tests.collab_processes import Collaboration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium)"
    ),
]
STEPS = 4
ENV = {
    "PEERTRAIN_TASK_MICRO_BATCH": "16",
    "PEERTRAIN_TASK_TARGET_BATCH": "64",
    "PEERTRAIN_TRAINING_GATHER_WINDOW": "1.0",
    "PEERTRAIN_TRAINING_PROGRESS_INTERVAL": "0.5",
    "PEERTRAIN_TRAINING_VALIDATION_INTERVAL": "2",
    "PEERTRAIN_DASHBOARD_INTERVAL": "0.5",
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def browse(url: str, profile: Path, *extra: str) -> str:
    """The page's DOM after its script ran (Chromium's virtual time lets its fetch finish)."""
    assert CHROMIUM is not None
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=5000",
         "--window-size=1280,1100", *extra, url],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def loss_points(dom: str) -> int:
    chart = re.search(r'<svg id="loss-chart"[^>]*>(.*?)</svg>', dom, re.S)
    assert chart, dom[-3000:]
    return chart[1].count('class="point"')


def applied(peer) -> int:
    """The highest step `peer` has applied (its JSON log)."""
    return max((r["applied"]["step"] for r in peer.records() if "applied" in r), default=0)


def peers_listed(dom: str) -> set[str]:
    return set(re.findall(r'<tr data-peer="([^"]+)"', dom))


def test_the_dashboard_draws_every_step_and_shows_a_peer_that_joins(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    collab = Collaboration(tmp_path, ENV)
    try:
        collab.start_backbone("--dashboard-port", str(port))
        pair = [collab.start_peer(0), collab.start_peer(1)]  # a step needs two signers
        deadline = time.monotonic() + 240
        while min(applied(peer) for peer in pair) < STEPS and time.monotonic() < deadline:
            time.sleep(0.5)
        trained = min(applied(peer) for peer in pair)
        assert trained >= STEPS, pair[0].log.read_text()[-3000:]
        dom = browse(url, tmp_path / "profile", "--dump-dom")
        # A point for every step, up to the global step the same read shows.
        shown = re.search(r"global step (\d+)", dom)
        assert shown, dom[-3000:]
        assert int(shown[1]) >= trained
        assert loss_points(dom) == int(shown[1]), dom[-3000:]
        assert "peertrain: default" in dom
        # A newcomer: listed once its presence is read.
        newcomer_proc = collab.start_peer(2)
        key = tmp_path / "peer2.key"
        deadline = time.monotonic() + 120
        while not key.exists() and time.monotonic() < deadline:  # the peer makes it
            time.sleep(0.2)
        time.sleep(0.5)  # written whole
        newcomer = str(load_or_create_identity(key).peer_id)
        while newcomer not in peers_listed(dom) and time.monotonic() < deadline:
            dom = browse(url, tmp_path / "profile", "--dump-dom")
        assert newcomer in peers_listed(dom), dom[-3000:]
        if shot := os.environ.get("PEERTRAIN_DASHBOARD_SCREENSHOT"):
            browse(url, tmp_path / "profile", f"--screenshot={shot}")
        del newcomer_proc
    finally:
        collab.close()
