"""Backbone: a stable, always-on node that peers join through.

Today a backbone is the daemon of `peer/daemon.py` in role "backbone" (`backbone start`): a DHT
server that also serves bandwidth probes (`peer/measure/probe.py`) and dial-back checks
(`peer/measure/reachability.py`) and aggregates with the share the role solver gives it. The
state keeper of the training issue will live here.
"""
