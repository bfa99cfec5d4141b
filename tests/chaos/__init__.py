"""Chaos suite: fault injection into real `backbone start` / `peer join` processes on loopback.

Run on its own (never collected by `pytest` or `pytest -m slow`; see conftest.py):

    .venv/bin/python -m pytest -n 0 -m chaos tests/chaos          # all four, ~10-15 minutes
    .venv/bin/python -m pytest -n 0 -m chaos tests/chaos -s       # and print each run's figures

Scenarios: test_peer_churn (a: random peers SIGKILLed and restarted), test_backbone_restart
(b: the backbone killed and restarted at the same address), test_checkpoint_kills (c: kills
during checkpoint writes), test_clock_skew (d: two peers with shifted wall clocks). Each checks
the invariants in invariants.py and writes its figures (one JSON line) to stdout and to
report.json in its tmp_path.
"""
