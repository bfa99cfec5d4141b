"""The collaboration's training in a backbone's log (`peer.training.collablog`)."""

from __future__ import annotations

from peer.training.collablog import StepClock, summary_line


def test_time_per_step_is_measured_between_new_global_steps():
    clock = StepClock()
    assert clock.observe(3, now=10.0) == (True, None)  # the first seen: no time yet
    assert clock.observe(3, now=15.0) == (False, None)  # the same step: no line
    assert clock.observe(5, now=30.0) == (True, 10.0)  # two steps in 20 s
    assert clock.observe(4, now=31.0) == (False, None)  # a stale read going back: ignored
    assert clock.observe(6, now=36.0) == (True, 6.0)


def test_the_line_names_the_figures_and_copes_with_unknowns():
    fields = {
        "step": 7, "trainers": 3, "trainers_behind": 1, "loss": 2.5, "samples_per_s": 812.5,
        "step_s": 12.0, "validation": None,
    }  # fmt: skip
    line = summary_line("demo", fields)
    assert line == (
        "collaboration 'demo': step 7, 3 trainers at it (1 behind), loss 2.5000, "
        "812.5 samples/s, 12.0 s per step"
    )
    unknown = summary_line("demo", {**fields, "loss": None, "step_s": None})
    assert "loss -" in unknown and "first step seen" in unknown


def test_a_collaboration_that_went_back_is_followed_again():
    """A restart from an older checkpoint (or a forged high step that expired): once the
    lower step persists, lines resume, instead of never again."""
    clock = StepClock()
    clock.observe(1000, now=0.0)
    assert [clock.observe(5, now=t)[0] for t in (1.0, 2.0, 3.0)] == [False, False, True]
    assert clock.observe(6, now=13.0) == (True, 10.0)


def test_the_json_log_writes_other_peers_overflowing_figures_as_null():
    import json
    import logging

    from peer.logs import JsonFormatter

    record = logging.makeLogRecord({"msg": "x", "collaboration": {"samples_per_s": float("inf")}})
    line = json.loads(JsonFormatter().format(record))  # strict JSON: no Infinity
    assert line["collaboration"] == {"samples_per_s": None}
