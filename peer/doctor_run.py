"""`peer doctor`'s observations and their run: files, sockets, torch and the backbones, each
wait under a deadline, the whole run under `DEADLINE`; the verdicts are in `peer.doctor`.

The network checks run a host with a throw-away identity on the configured listen and announce
addresses. Not the real key: a running peer holds its lock (`hold_identity`), and a dial-back
proves that the address answers, whatever key answers there. A port held by a running
peertrain node is reported as such, and the checks that need no listening run without it.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psutil
import trio
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.peer.id import ID
from libp2p.security.noise.exceptions import PeerIDMismatchesPubkey
from libp2p.transport.exceptions import SecurityUpgradeFailure
from multiaddr import Multiaddr

from peer.config import PeerConfig, TaskConfig
from peer.daemon import parse_backbones
from peer.doctor import (
    CHECKS,
    BackboneContact,
    DiskProbe,
    Finding,
    KeyProbe,
    Report,
    announce_verdict,
    backbone_verdict,
    bandwidth_verdict,
    disk_verdict,
    fixed_port,
    host_port,
    identity_verdict,
    is_peertrain_command,
    listen_verdict,
    memory_verdict,
    no_backbone,
    not_checked,
    reachability_finding,
    skew_verdict,
)
from peer.errors import ConfigError, RemoteError
from peer.files import state_folder
from peer.measure.clock import MAX_CORRECTION, clock_offset, sample_clock
from peer.measure.probe import measure_link
from peer.measure.reachability import check_reachable
from peer.measure.service import reachability_verdict
from peer.net.host import Node, bind_error, open_node, parse_multiaddr
from peer.net.identity import ephemeral_identity
from peer.net.network_key import load_network_key

__all__ = ["DEADLINE", "check_device", "inspect_disk", "inspect_key", "run_doctor"]

T = TypeVar("T")


def inspect_key(path: Path) -> KeyProbe:
    """Look at the key file without creating, locking or changing anything."""
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):  # missing, or a file where a folder goes
        return KeyProbe(path, exists=False, folder_error=try_write(nearest_existing(path.parent)))
    except OSError as error:
        return KeyProbe(path, exists=True, is_file=True, read_error=error.strerror)
    if not stat.S_ISREG(st.st_mode):
        return KeyProbe(path, exists=True)
    mode = stat.S_IMODE(st.st_mode)
    try:
        with open(path, "rb") as file:
            data = file.read(4096)
    except OSError as error:
        return KeyProbe(path, exists=True, is_file=True, mode=mode, read_error=error.strerror)
    peer_id = None
    try:
        private = Ed25519PrivateKey.from_bytes(data)
        peer_id = ID.from_pubkey(private.get_public_key()).to_base58()
    except Exception:  # any malformed key: reported as such, whatever the library raises
        pass
    return KeyProbe(
        path,
        exists=True,
        is_file=True,
        mode=mode,
        size=len(data),
        peer_id=peer_id,
        holder_pid=_lock_holder(path.with_name(f"{path.name}.lock")),
    )


def _lock_holder(lock: Path) -> int | None:
    """The pid a running daemon wrote into the lock file, if that process is alive. Read only:
    taking the lock, even briefly, could make a daemon starting right now fail."""
    try:
        text = lock.read_text(errors="replace").strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) == os.getpid():
        return None
    return int(text) if psutil.pid_exists(int(text)) else None


def inspect_disk(path: Path) -> DiskProbe:
    existing = nearest_existing(path)
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        free = 0
    return DiskProbe(path, existing, free, try_write(existing))


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def try_write(folder: Path) -> str | None:
    """Create and delete a file in `folder`: the only test that holds for root, ACLs and
    read-only mounts alike. Returns why it failed, or None."""
    if not folder.is_dir():
        return "not a folder"
    try:
        descriptor, temp = tempfile.mkstemp(prefix=".peertrain-doctor-", dir=folder)
    except OSError as error:
        return error.strerror or str(error)
    os.close(descriptor)
    os.unlink(temp)
    return None


def local_ips() -> list[str]:
    return [
        addr.address.split("%")[0]
        for addrs in psutil.net_if_addrs().values()
        for addr in addrs
        if addr.family.name in ("AF_INET", "AF_INET6")
    ]


def listen_blocked(listen: Sequence[str]) -> Finding | None:
    """A plain bind of each ip4/tcp listen address, as `open_node` tries before listening;
    a finding when one fails, naming the process that holds the port."""
    for text in listen:
        maddr = parse_multiaddr(text, what="listen address")
        error = bind_error(maddr)
        if error is not None:
            port = int(maddr.value_for_protocol("tcp"))  # bind_error checks only ip4/tcp
            cmdline, holder = port_holder(port)
            return listen_verdict(
                text,
                error.strerror or str(error),
                holder=holder,
                peertrain=is_peertrain_command(cmdline),
            )
    return None


def port_holder(port: int) -> tuple[list[str], str | None]:
    """(command line, "pid N: command") of the process listening on TCP `port`, if visible."""
    try:
        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
                cmdline = psutil.Process(conn.pid).cmdline()
                command = " ".join(" ".join(cmdline).split())  # one line, whatever argv holds
                return cmdline, f"pid {conn.pid}: {command[:100]}"
    except psutil.Error:  # another user's process, or no permission to list sockets
        pass
    return [], None


def check_device(task: TaskConfig) -> tuple[Finding, int]:
    """The device `peer join` would train on, its free memory, and the task's parameter bytes
    (blocking: imports torch and builds the task's model)."""
    from peer.measure.compute import free_memory, pick_device
    from peer.training.task import load_task

    try:
        device = pick_device(task.device)
    except ConfigError as error:
        return Finding("device", "fail", str(error), "set task.device to auto or cpu"), 0
    try:
        model = load_task(task.name, task.args).build_model()
    except ConfigError as error:
        advice = "set task.name to gpt, tiny, or a package.module:factory importable here"
        return Finding("device", "fail", str(error), advice), 0
    except Exception as error:  # a user's task code: what it raises is the finding
        message = f"task.name = {task.name!r}: building its model raised {error!r}"
        return Finding("device", "fail", message, "fix the task's build_model()"), 0
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    finding = memory_verdict(
        device=str(device), free_bytes=free_memory(device), model_bytes=model_bytes
    )
    return finding, model_bytes


# ---------------------------------------------------------------------------- the run

DEADLINE = 30.0
"""Seconds the whole doctor may take; the phases below add up to less."""
CONNECT_SECONDS = 5.0
BACKBONE_SECONDS = 7.0  # connect + pings
PINGS = 5
REACH_SECONDS = 7.0  # a backbone tries each matching address for 5 s
BANDWIDTH_SECONDS = 8.0
LOCAL_WAIT_SECONDS = 4.0  # how long the bandwidth probe waits for the device check to finish
BANDWIDTH_TARGET_SECONDS = 1.0
BANDWIDTH_MAX_BYTES = 16 << 20


async def run_doctor(config: PeerConfig, *, deadline: float = DEADLINE) -> list[Finding]:
    """Every check's findings, in CHECKS order. A check that has not finished by `deadline`
    fails with that message; ConfigError for a malformed address."""
    found: list[Finding] = []
    device_checked = trio.Event()
    with trio.move_on_after(deadline):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_identity_check, config, found.append)
            nursery.start_soon(_device_and_disk_checks, config, found.append, device_checked)
            await _network_checks(config, found.append, device_checked)
    for name in CHECKS:
        if not any(f.name == name for f in found):
            found.append(
                Finding(
                    name,
                    "fail",
                    f"did not finish within {deadline:g} s",
                    "run `peer doctor --log-level debug` to see what hangs",
                )
            )
    return sorted(found, key=lambda f: CHECKS.index(f.name))


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    # abandon_on_cancel: a hung filesystem or a slow torch import must not outlast the deadline.
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


async def _identity_check(config: PeerConfig, report: Report) -> None:
    key = Path(config.identity.path).expanduser()
    report(identity_verdict(await _in_thread(inspect_key, key)))


async def _device_and_disk_checks(
    config: PeerConfig, report: Report, device_checked: trio.Event
) -> None:
    try:
        finding, model_bytes = await _in_thread(check_device, config.task)
    finally:
        device_checked.set()
    report(finding)
    # The folder the trainer writes to, per collaboration and task.
    folder = state_folder(
        config.training.checkpoint_dir, config.collaboration.name, config.task.name
    )
    report(disk_verdict(await _in_thread(inspect_disk, folder), model_bytes=model_bytes))


async def _network_checks(config: PeerConfig, report: Report, device_checked: trio.Event) -> None:
    net, backbones = config.net, config.collaboration.backbones
    seeds = parse_backbones(backbones)
    report(
        announce_verdict(
            listen=net.listen, announce=net.announce, backbones=backbones, local_ips=local_ips()
        )
    )
    if not seeds:
        report(no_backbone())
        for name in ("reachability", "clock", "bandwidth"):
            report(not_checked(name, "no backbone configured"))
        return
    blocked = await _in_thread(listen_blocked, net.listen)
    if blocked is not None:
        report(blocked)
    # A blocked port cannot be tested from here; with no listen address the rest still runs.
    listen, announce = ([], []) if blocked else (net.listen, net.announce)
    async with open_node(
        ephemeral_identity(),
        listen=listen,
        announce=announce,
        max_message_bytes=net.max_message_bytes,
        network_key=load_network_key(config.collaboration.network_key),
    ) as node:
        contacts: dict[int, BackboneContact] = {}

        async def contact(i: int) -> None:
            peer_id, addr = seeds[i]
            contacts[i] = await contact_backbone(node, peer_id, addr, text=backbones[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(seeds)):
                nursery.start_soon(contact, i)
        for i in range(len(seeds)):
            report(backbone_verdict(contacts[i]))
        answered = sorted(
            (c for c in contacts.values() if c.rtt_s is not None), key=lambda c: c.rtt_s or 0.0
        )
        if not answered:
            for name in ("clock", "bandwidth", *(() if blocked else ("reachability",))):
                report(not_checked(name, "no backbone answered"))
            return
        best = answered[0]
        report(
            skew_verdict(
                clock_offset(best.samples),
                backbone=host_port(best.addr),
                fail_above=MAX_CORRECTION,
            )
        )
        if blocked is None:
            report(await _check_reachability(node, answered, port=fixed_port(net.listen)))
        # Importing torch and building the model hold the GIL for a second or two: a probe
        # meanwhile would measure them, not the link.
        with trio.move_on_after(LOCAL_WAIT_SECONDS):
            await device_checked.wait()
        report(await _check_bandwidth(node, best))


async def contact_backbone(
    node: Node, peer_id: ID, addr: Multiaddr, *, text: str
) -> BackboneContact:
    """Connect and ping, as `peer join` must first; the pings carry the backbone's clock."""
    try:
        with trio.fail_after(BACKBONE_SECONDS):
            await node.connect(peer_id, [addr], timeout=CONNECT_SECONDS)
            samples = await sample_clock(node, peer_id, count=PINGS)
    except trio.TooSlowError:
        error = f"no answer within {BACKBONE_SECONDS:g} s"
        return BackboneContact(text, str(peer_id), None, error=error)
    except RemoteError as error:
        return BackboneContact(text, str(peer_id), None, error=dial_failure(error))
    rtt = min(s.received - s.sent for s in samples)
    return BackboneContact(text, str(peer_id), rtt, tuple(samples))


def dial_failure(error: BaseException) -> str:
    """Why a dial failed, in words, from py-libp2p's wrapped errors (causes, contexts,
    MultiError.errors, exception groups): the OS's reason, a key that is not the one the
    address names, or something else answering there; else the error's own text."""
    stack, seen, chain = [error], set(), []
    while stack:
        current = stack.pop()
        if id(current) not in seen:
            seen.add(id(current))
            chain.append(current)
            stack.extend(getattr(current, "errors", None) or ())
            stack.extend(getattr(current, "exceptions", None) or ())
            stack.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    for current in chain:
        if isinstance(current, OSError) and current.errno:
            return os.strerror(current.errno)
    if any(isinstance(current, PeerIDMismatchesPubkey) for current in chain):
        return "a node with another peer id answers there (the /p2p/ part is not its id)"
    if any(isinstance(current, SecurityUpgradeFailure) for current in chain):
        return "something that is not a peertrain node answers there (no Noise handshake)"
    return str(error)


async def _check_reachability(
    node: Node, answered: Sequence[BackboneContact], *, port: str | None
) -> Finding:
    """Ask the backbones, nearest first, to dial us back, until one gives a definite answer."""
    problems: list[str] = []
    last: Finding | None = None
    with trio.move_on_after(REACH_SECONDS):
        for contact in answered:
            backbone = host_port(contact.addr)
            try:
                result = await check_reachable(node, ID.from_base58(contact.peer_id))
            except RemoteError as error:
                problems.append(f"{backbone}: {error}")
                continue
            last = reachability_finding(result, backbone=backbone, port=port)
            if reachability_verdict(result) is not None:
                return last
    if last is not None:
        return last
    why = "; ".join(problems) or f"no dial-back report within {REACH_SECONDS:g} s"
    return Finding(
        "reachability",
        "warn",
        f"not checked: {why}",
        "run `peer doctor` again; the backbone may be overloaded or an older version",
    )


async def _check_bandwidth(node: Node, contact: BackboneContact) -> Finding:
    backbone = host_port(contact.addr)
    try:
        with trio.fail_after(BANDWIDTH_SECONDS):
            link = await measure_link(
                node,
                ID.from_base58(contact.peer_id),
                target_seconds=BANDWIDTH_TARGET_SECONDS,
                max_bytes=BANDWIDTH_MAX_BYTES,
                pings=1,
            )
    except trio.TooSlowError:
        return Finding(
            "bandwidth",
            "warn",
            f"the probe against backbone {backbone} did not finish within "
            f"{BANDWIDTH_SECONDS:g} s: the link is very slow or stalls",
            "use a wired connection or pause other transfers, then run `peer doctor` again",
        )
    except RemoteError as error:
        return Finding(
            "bandwidth",
            "warn",
            f"not measured: {error}",
            "run `peer doctor` again in a minute (backbones limit each caller's probes)",
        )
    return bandwidth_verdict(link, backbone=backbone)
