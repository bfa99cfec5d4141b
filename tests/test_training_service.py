"""The deadlines of a trainer's state downloads scale with the state's bytes (pure)."""

from __future__ import annotations

from peer.config import PeerConfig
from peer.training.service import download_seconds, manifest_seconds

GB = 10**9


def test_a_manifest_waits_for_the_donor_to_prepare_a_large_state():
    config = PeerConfig()
    assert manifest_seconds(config, 0) == config.net.rpc_timeout  # 5 s, as before, for nothing
    # A 100 M-parameter model with AdamW: ~1.6 GB at most, 16 s to serialize and hash at the
    # 100 MB/s assumed of a loaded donor (the fixed 5 s cut off the first downloads of 38 M).
    assert manifest_seconds(config, 1.6 * GB) == config.net.rpc_timeout + 16


def test_a_download_has_time_for_its_bytes_at_a_third_of_the_measured_bandwidth():
    config = PeerConfig()
    floor = config.state.download_timeout
    assert download_seconds(config, 1 * GB, None) == floor  # nothing measured: the setting
    assert download_seconds(config, 1 * GB, 1e9) == floor  # fast: the setting
    # 1 GB at 10 MB/s measured: 300 s of transfer (a third of the link) + the manifest.
    assert download_seconds(config, 1 * GB, 10e6) == manifest_seconds(config, 1 * GB) + 300
