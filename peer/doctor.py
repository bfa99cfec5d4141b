"""`peer doctor`: what would stop this machine from joining a collaboration, and how to fix it.

Each check yields a `Finding` (ok / warn / fail, a one-line message, and for warn and fail one
line of advice):

    backbone      each configured backbone answers a connect + ping
    reachability  a backbone dials us back on the configured listen / announce addresses
    announce      loopback-only addresses while a backbone is on another machine
    clock         our wall clock against a backbone's (`Pong.server_time`)
    device        the torch device the task would use, and its free memory
    bandwidth     upload and download against a backbone (the link probe)
    disk          free space and writability of `training.checkpoint_dir`
    identity      the key file: present or creatable, readable, private, well-formed

This module holds the decisions: pure functions of what was observed (`*_verdict`), tested
without sockets or files. `peer.doctor_run` observes (files, sockets, torch, the backbones) with
a deadline on every wait, and calls them.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from peer.measure.clock import ClockSample, clock_offset
from peer.measure.probe import LinkMeasurement
from peer.measure.reachability import DialBackResult
from peer.measure.service import reachability_verdict
from peer.training.timing import MAX_DECLARE_MARGIN

__all__ = [
    "CHECKS",
    "BackboneContact",
    "ClockSample",
    "DiskProbe",
    "Finding",
    "KeyProbe",
    "announce_verdict",
    "backbone_verdict",
    "bandwidth_verdict",
    "clock_offset",
    "disk_verdict",
    "identity_verdict",
    "listen_verdict",
    "memory_verdict",
    "no_backbone",
    "not_checked",
    "reachability_finding",
    "skew_verdict",
]

Level = Literal["ok", "warn", "fail"]
CHECKS = (
    "backbone",
    "reachability",
    "announce",
    "clock",
    "device",
    "bandwidth",
    "disk",
    "identity",
)

SKEW_WARN = MAX_DECLARE_MARGIN / 2
"""Seconds of clock skew worth a warning (0.5). A step's averaging starts at a wall-clock time
and a peer stops computing `Timing.declare_margin` before it (`min(gather_window / 4, 1 s)`,
0.5 s by default); the chaos suite saw peers 1 s off apply no step at all, only download the
others' state."""
MIN_FREE_MEMORY = 1 << 30
# Weights, gradients and Adam's two moments are 4x the parameters; the flat vector averaging
# sends and a downloaded state add about as much again.
MEMORY_PER_PARAMETER_BYTE = 8
MIN_FREE_DISK = 1 << 30
# A checkpoint holds weights and optimizer state (~3x the parameters); two are kept and a third
# is written before the oldest goes.
DISK_PER_PARAMETER_BYTE = 9
MIN_BANDWIDTH = 125_000.0
"""Bytes/s (1 Mbit/s) below which averaging rounds take minutes even for small models."""


@dataclass(frozen=True)
class Finding:
    name: str
    """One of CHECKS."""
    level: Level
    message: str
    """What was found, one line."""
    advice: str | None = None
    """What to do about it (warn and fail only)."""


Report = Callable[[Finding], None]


def not_checked(name: str, why: str) -> Finding:
    return Finding(
        name,
        "warn",
        f"not checked: {why}",
        "fix the problem above, then run `peer doctor` again",
    )


# ---------------------------------------------------------------------------- backbones


@dataclass(frozen=True)
class BackboneContact:
    addr: str
    """The full multiaddr as configured."""
    peer_id: str
    rtt_s: float | None
    """Fastest ping; None when it did not answer."""
    samples: tuple[ClockSample, ...] = ()
    error: str | None = None


def no_backbone() -> Finding:
    return Finding(
        "backbone",
        "fail",
        "no backbone configured: a peer joins a collaboration through one",
        "pass --backbone MADDR (as printed by `backbone start`), or set "
        "collaboration.backbones in the config file",
    )


def backbone_verdict(contact: BackboneContact) -> Finding:
    if contact.rtt_s is not None:
        return Finding("backbone", "ok", f"{contact.addr} answered in {contact.rtt_s * 1e3:.1f} ms")
    host = host_port(contact.addr)
    return Finding(
        "backbone",
        "fail",
        f"cannot join through {contact.addr}: {contact.error}",
        f"check that `backbone start` runs at {host} and printed exactly this address (its "
        f"/p2p/ id included), that no firewall blocks outgoing TCP to {host}, and, for a "
        f"private collaboration, that you pass its --network-key",
    )


def skew_verdict(
    estimate: tuple[float, float] | None,
    *,
    backbone: str,
    warn_above: float = SKEW_WARN,
    fail_above: float,
) -> Finding:
    """Warn above `warn_above` seconds of skew beyond the measurement's uncertainty; fail above
    `fail_above` (what a peer corrects for, peer.measure.clock.MAX_CORRECTION: beyond it, a
    clock that far behind publishes records that are already expired)."""
    advice = "synchronise this machine's clock: enable NTP (`timedatectl set-ntp true`)"
    if estimate is None:
        return Finding(
            "clock",
            "warn",
            f"not checked: backbone {backbone} runs an older peertrain that does not report its time",
            advice,
        )
    offset, uncertainty = estimate
    margin = f"+- {uncertainty * 1e3:.1f} ms"
    skew = abs(offset) - uncertainty
    if skew <= warn_above:
        return Finding(
            "clock", "ok", f"within {abs(offset):.2f} s of backbone {backbone} ({margin})"
        )
    side = "behind" if offset > 0 else "ahead of"
    figure = f"{abs(offset):.2f} s {side} backbone {backbone} ({margin})"
    if skew > fail_above:
        return Finding(
            "clock",
            "fail",
            f"{figure}: more than a peer corrects for ({fail_above:g} s), so other peers "
            "would drop this peer's records as expired",
            advice,
        )
    return Finding(
        "clock",
        "warn",
        f"{figure}: a peer reads the backbones' time for training (steps start at "
        "wall-clock times, gather_until), but this machine's other programs see this clock",
        advice,
    )


# ---------------------------------------------------------------------------- addresses


def is_loopback(addr: str, *, local_ips: Sequence[str] = ()) -> bool:
    """Whether a multiaddr reaches only this machine: 127.0.0.0/8, ::1, `localhost`, or a
    wildcard (0.0.0.0, ::) when every local address of that family is loopback."""
    parts = addr.split("/")
    if len(parts) < 3:
        return False
    proto, host = parts[1], parts[2]
    if proto in ("dns", "dns4", "dns6"):
        return host == "localhost"
    if proto not in ("ip4", "ip6"):
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_unspecified:
        family = [
            ipaddress.ip_address(local)
            for local in local_ips
            if ipaddress.ip_address(local).version == ip.version
        ]
        return all(local.is_loopback for local in family)
    return ip.is_loopback


def announce_verdict(
    *,
    listen: Sequence[str],
    announce: Sequence[str],
    backbones: Sequence[str],
    local_ips: Sequence[str],
) -> Finding:
    """Fail when every address this peer would announce is loopback while a backbone is not:
    the backbone, and every peer it tells about us, would dial their own machine."""
    advertised = list(announce or listen)
    port = fixed_port(listen) or "<port>"
    if not advertised:
        return Finding(
            "announce",
            "warn",
            "no listen address: this peer can dial out but nobody can dial it (client-only)",
            f"listen on all interfaces: --listen /ip4/0.0.0.0/tcp/{port}",
        )
    remote = [b for b in backbones if not is_loopback(b)]
    local_only = all(is_loopback(a, local_ips=local_ips) for a in advertised)
    if local_only and remote:
        return Finding(
            "announce",
            "fail",
            f"this peer would announce only loopback addresses ({', '.join(advertised)}) but "
            f"backbone {remote[0]} is on another machine, which cannot dial them",
            f"pass --announce /ip4/<public-ip>/tcp/{port}, or listen on all interfaces "
            f"(--listen /ip4/0.0.0.0/tcp/{port})",
        )
    which = "announces" if announce else "listens on"
    return Finding("announce", "ok", f"{which} {', '.join(advertised)}")


def fixed_port(listen: Sequence[str]) -> str | None:
    """The first non-zero TCP port among the listen addresses."""
    return next((p for a in listen if (p := _tcp_port(a)) not in (None, "0")), None)


def _tcp_port(addr: str) -> str | None:
    parts = addr.split("/")
    return parts[parts.index("tcp") + 1] if "tcp" in parts[:-1] else None


def host_port(addr: str) -> str:
    parts = addr.split("/")
    port = _tcp_port(addr)
    host = parts[2] if len(parts) > 2 else addr
    return f"{host}:{port}" if port else host


# ---------------------------------------------------------------------------- reachability


def reachability_finding(result: DialBackResult, *, backbone: str, port: str | None) -> Finding:
    """`port`: the configured TCP port, None when it is 0 (a new one each start)."""
    verdict = reachability_verdict(result)
    if verdict is True:
        return Finding(
            "reachability",
            "ok",
            f"backbone {backbone} dialed this machine back at {result.reachable[0]}",
        )
    if verdict is None:
        return Finding(
            "reachability",
            "warn",
            f"not checked: backbone {backbone} is busy",
            "run `peer doctor` again in a minute",
        )
    tried = "; ".join(f"{addr}: {why}" for addr, why in list(result.unreachable.items())[:3])
    fixed = "" if port else "listen on a fixed port (--port 31337), "
    port = port or "31337"
    return Finding(
        "reachability",
        "warn",
        f"client-only: backbone {backbone} could not dial this machine back "
        f"({tried or 'no address announced'}); it will compute but never aggregate",
        f"{fixed}forward TCP port {port} on your router or firewall to this machine and pass "
        f"--announce /ip4/<public-ip>/tcp/{port} (net.announce in the config)",
    )


def listen_verdict(addr: str, error: str, *, holder: str | None, peertrain: bool) -> Finding:
    """The configured listen address cannot be bound. If a peertrain node holds it, that is
    a running peer, not a problem; anything else would make `peer join` fail."""
    if peertrain:
        return Finding(
            "reachability",
            "warn",
            f"not checked: {addr} is in use by a running peertrain node ({holder})",
            "`peer status` shows whether that peer is reachable; or stop it and run "
            "`peer doctor` again",
        )
    by = f" (held by {holder})" if holder else ""
    if holder or "in use" in error:
        advice = "pick another --port, or stop the program that uses it"
    else:
        advice = (
            "listen on an address of this machine (--listen /ip4/0.0.0.0/tcp/<port>) and put "
            "the public address in --announce"
        )
    return Finding("reachability", "fail", f"cannot listen on {addr}: {error}{by}", advice)


def is_peertrain_command(cmdline: Sequence[str]) -> bool:
    """A `peer join` / `backbone start` process, however it was started."""
    names = [os.path.basename(arg) for arg in cmdline]
    return any(
        name in ("peer", "backbone") or "peer_cli" in name or "backbone_cli" in name
        for name in names
    )


# ---------------------------------------------------------------------------- local resources


def memory_verdict(*, device: str, free_bytes: int, model_bytes: int) -> Finding:
    need = max(MIN_FREE_MEMORY, MEMORY_PER_PARAMETER_BYTE * model_bytes)
    figure = f"{device}: {_size(free_bytes)} free; the task's parameters take {_size(model_bytes)}"
    if free_bytes < need:
        return Finding(
            "device",
            "warn",
            f"{figure}, and training wants about {_size(need)}",
            f"close programs that use {device} memory, or set task.device to a device with "
            "more free memory",
        )
    return Finding("device", "ok", figure)


def bandwidth_verdict(link: LinkMeasurement, *, backbone: str) -> Finding:
    figure = (
        f"up {link.upload_bps / 1e6:.2f} MB/s, down {link.download_bps / 1e6:.2f} MB/s, "
        f"rtt {link.rtt_s * 1e3:.1f} ms to backbone {backbone}"
    )
    if min(link.upload_bps, link.download_bps) < MIN_BANDWIDTH:
        return Finding(
            "bandwidth",
            "warn",
            f"{figure}: below {MIN_BANDWIDTH * 8 / 1e6:g} Mbit/s, every averaging round will be slow",
            "use a wired connection or pause other transfers; a slow peer still helps by computing",
        )
    return Finding("bandwidth", "ok", figure)


@dataclass(frozen=True)
class DiskProbe:
    path: Path
    """training.checkpoint_dir, expanded."""
    existing: Path
    """It, or its nearest existing parent (where a write was tried)."""
    free_bytes: int
    write_error: str | None
    """None when a file could be created there."""


def disk_verdict(probe: DiskProbe, *, model_bytes: int) -> Finding:
    if probe.write_error is not None:
        return Finding(
            "disk",
            "fail",
            f"checkpoints cannot be written to {probe.path}: {probe.existing}: {probe.write_error}",
            f"make {probe.existing} writable (chown / chmod), or set training.checkpoint_dir to "
            "a writable folder",
        )
    need = max(MIN_FREE_DISK, DISK_PER_PARAMETER_BYTE * model_bytes)
    figure = f"{probe.path}: {_size(probe.free_bytes)} free"
    if probe.free_bytes < need:
        return Finding(
            "disk",
            "warn",
            f"{figure}; checkpoints want about {_size(need)}",
            "free some space, or set training.checkpoint_dir to a folder on a larger disk",
        )
    return Finding("disk", "ok", f"{figure}, writable")


@dataclass(frozen=True)
class KeyProbe:
    """What is on disk at `identity.path`."""

    path: Path
    exists: bool
    is_file: bool = False
    mode: int = 0
    """Permission bits."""
    read_error: str | None = None
    size: int = 0
    peer_id: str | None = None
    """Derived from the key; None when it does not decode."""
    folder_error: str | None = None
    """Why no key could be created in its folder (a missing key only); None if one can."""
    holder_pid: int | None = None
    """A live process named in `<key>.lock`: a daemon using this key."""


def identity_verdict(probe: KeyProbe, *, key_bytes: int = 32) -> Finding:
    path = probe.path
    if not probe.exists:
        if probe.folder_error is None:
            return Finding("identity", "ok", f"{path} does not exist yet; `peer join` creates it")
        return Finding(
            "identity",
            "fail",
            f"{path} does not exist and cannot be created: {probe.folder_error}",
            "pass --identity FILE in a writable folder, or make the folder writable",
        )
    if not probe.is_file:
        return Finding(
            "identity",
            "fail",
            f"{path} is not a regular file",
            "move it away (a new key is then created) or pass --identity FILE",
        )
    if probe.read_error is not None:
        return Finding(
            "identity",
            "fail",
            f"cannot read {path}: {probe.read_error}",
            f"run peertrain as the key's owner, or `chown $(id -un) {path} && chmod 600 {path}`",
        )
    if probe.size != key_bytes or probe.peer_id is None:
        return Finding(
            "identity",
            "fail",
            f"{path} is not an Ed25519 key ({probe.size} bytes, expected {key_bytes})",
            "restore it from a backup, or move it away to create a new identity",
        )
    # `peer join` refuses such a key (peer/net/identity.py), so this is a failure, not a hint.
    if probe.mode & 0o077:
        return Finding(
            "identity",
            "fail",
            f"{path} is accessible by group or others (mode {probe.mode:04o}); `peer join` "
            "refuses it",
            f"chmod 600 {path}",
        )
    if probe.holder_pid is not None:
        return Finding(
            "identity",
            "warn",
            f"{path} (peer {probe.peer_id}) is in use by a running daemon (pid "
            f"{probe.holder_pid}); a second `peer join` with it is refused",
            f"stop pid {probe.holder_pid} first, or pass --identity with another key file",
        )
    return Finding("identity", "ok", f"{path}: peer {probe.peer_id}")


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"
