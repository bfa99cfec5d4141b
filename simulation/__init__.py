"""Collaborations of hundreds of simulated volunteers in one process, on trio's virtual clock:
the real DHT, matchmaking, Moshpit plan and step policy over simulated links
(`collaboration.py`; `python -m simulation`; figures in docs/scale.md)."""
