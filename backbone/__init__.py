"""Backbone: a stable, always-on node that peers join through.

Today a backbone is the daemon of `peer/daemon.py` in role "backbone" (`backbone start`); the
bandwidth-probe and state-keeper services of later issues live here.
"""
