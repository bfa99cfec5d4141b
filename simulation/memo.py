"""The process's memo caches sized for every simulated node at once (wall time only).

A real peer remembers the records, signatures, contacts and addresses it met lately in caches
sized for one node (`peer.dht.records.VERIFIED_CACHE`, `peer.training.progress.DECODED_RECORDS`
and the `functools.lru_cache`s below). The simulation runs every node in one process, so those
caches serve all of them: at 1,000 simulated peers the live progress records (1,000-2,000
versions, read by every node in turn) are about as many as the 2,048 decoded records one
node keeps, and where they outnumber an LRU cache read in turn, every read misses and pays a
decode and an Ed25519 check again. (In the first 10 virtual seconds at 1,000 peers both sizes
hit 99 % of the time; a steady state was not measured.)

`widened(nodes)` gives each of them room for `nodes` nodes while a run lasts and puts the
originals back after. A memo only remembers results of pure functions, so the run's figures
are the same with either size (the test that runs a scenario at both says so); what a node's
CPU is charged for its checks counts each node's own memory (`simulation.cpu`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

from peer.dht import node as dht_node
from peer.dht import protocol, records, routing
from peer.net import host, prefix
from peer.training import certificate, progress, shards
from simulation import cpu

NODES_PER_CACHE = 16
"""Nodes a cache is sized for: below it, the caches keep their own size."""
MAX_ENTRIES = 1 << 17
"""A cache's entries at most, however many nodes (decoded records are a few KB each)."""


def _memos() -> list[tuple[Any, str]]:
    """(module, name) of every memo whose size is per node."""
    return [
        (progress, "_decoded"),
        (progress, "_checked"),
        (cpu, "_step_signatures"),
        (certificate, "_valid"),
        (records, "owner_key"),
        (records, "_subkey_hash"),
        (protocol, "_wire_contact"),
        (protocol, "_peer_id"),
        (protocol, "_contact"),
        (routing, "node_id"),
        (routing, "key_id"),
        (routing, "_spread"),
        (shards, "_place"),
        (host, "_parse_addr"),
        (prefix, "prefix_of"),
        (dht_node, "_direct_addr"),
    ]


def _rebind(old: object, new: object) -> list[tuple[Any, str]]:
    """Every `peer` and `simulation` module attribute bound to `old`, now bound to `new`
    (modules that imported the function by name hold their own binding)."""
    bound = []
    for name, module in list(sys.modules.items()):
        if not name.startswith(("peer.", "simulation.")) or module is None:
            continue
        for attribute, value in list(vars(module).items()):
            if value is old:
                setattr(module, attribute, new)
                bound.append((module, attribute))
    return bound


@contextlib.contextmanager
def widened(nodes: int) -> Iterator[None]:
    """While this lasts, the memos hold `nodes / NODES_PER_CACHE` times their own size."""
    scale = max(1, -(-nodes // NODES_PER_CACHE))
    undo: list[tuple[Any, str, object]] = []
    verified = records.VERIFIED_CACHE
    try:
        for module, name in _memos():
            cached: Callable[..., Any] = getattr(module, name)
            size = cached.cache_info().maxsize  # type: ignore[attr-defined]
            if size is None or scale == 1:
                continue
            wider = functools.lru_cache(maxsize=max(size, min(MAX_ENTRIES, size * scale)))(
                cached.__wrapped__  # type: ignore[attr-defined]
            )
            undo += [(m, a, cached) for m, a in _rebind(cached, wider)]
        records.VERIFIED_CACHE = max(verified, min(MAX_ENTRIES, verified * scale))
        yield
    finally:
        for module, attribute, original in reversed(undo):
            setattr(module, attribute, original)
        records.VERIFIED_CACHE = verified
        while len(records._VERIFIED) > verified:
            records._VERIFIED.popitem(last=False)
