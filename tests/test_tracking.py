"""Experiment tracking (`peer.training.tracking`): TensorBoard scalars of a peer's training
and of the user's own metrics."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from peer.errors import ConfigError
from peer.training.tracking import Tracker, check_tracking, open_tracker, user_metrics


def scalars(directory) -> dict[str, list[tuple[int, float]]]:
    (folder,) = [p for p in directory.iterdir() if p.name.startswith("peer-")]
    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, round(e.value, 6)) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def test_a_peer_s_scalars_are_written_by_step_and_unknowns_left_out(tmp_path):
    tracker = open_tracker(str(tmp_path), "12D3KooWabcdefgh")
    tracker.scalars(1, {"train/loss": 2.5, "step/peers": 3, "step/global_batch": None})
    tracker.scalars(2, {"train/loss": 2.25, "step/peers": 2, "train/samples_per_s": float("nan")})
    tracker.close()
    assert (tmp_path / "peer-abcdefgh").is_dir()
    assert scalars(tmp_path) == {
        "train/loss": [(1, 2.5), (2, 2.25)],
        "step/peers": [(1, 3.0), (2, 2.0)],
    }


def test_no_directory_is_no_tracking(tmp_path):
    tracker = open_tracker("", "12D3KooWabcdefgh")
    assert type(tracker) is Tracker
    tracker.scalars(1, {"train/loss": 1.0})  # nothing, and no error
    assert not list(tmp_path.iterdir())


def test_user_metrics_take_numbers_of_any_kind_and_refuse_the_rest():
    assert user_metrics({"acc": 1, "lr": np.float32(0.5), "t": torch.tensor(2.0)}) == {
        "user/acc": 1.0,
        "user/lr": 0.5,
        "user/t": 2.0,
    }
    for bad in ({"acc": float("inf")}, {"acc": "high"}, {"": 1.0}, {"acc": [1, 2]}, {3: 1.0}):
        with pytest.raises(ValueError):
            user_metrics(bad)


def test_a_tensorboard_dir_without_tensorboard_is_a_one_line_config_error(monkeypatch):
    check_tracking("")  # not asked for: nothing to check
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails
    with pytest.raises(ConfigError, match="pip install tensorboard") as caught:
        check_tracking("/tmp/tb")
    assert "\n" not in str(caught.value)
