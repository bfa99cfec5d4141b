"""A user-space Ethernet switch that delays and drops frames: per-peer latency and loss without netem.

    python3 deploy/impair.py [--seed N] [--queue-limit FRAMES] PORT=DELAY,LOSS ...
    python3 deploy/impair.py offloads-off DEVICE

deploy/testbed.sh runs the first form inside its `<prefix>sw` namespace in place of the kernel
bridge when the kernel has no sch_netem (`--shaper user`). Each PORT is a veth end in that
namespace (bb, p1, ...), attached to no bridge; the switch opens one AF_PACKET socket per port and:

- learns source MACs (a MAC seen on port P is reachable through P; entries age out after
  MAC_AGE seconds), forwards a unicast frame to its learned port and floods broadcast,
  multicast and unknown destinations to every other port;
- drops a frame with the ingress port's loss probability, then each copy with the egress port's
  (independent draws from one seeded RNG, as netem on both ends of the veth would);
- releases each copy DELAY(ingress) + DELAY(egress) after it arrived, so a peer's RTT to the
  unimpaired backbone is twice its delay, as with netem on both ends of its link.

Order per (ingress, egress) pair is kept: the delay of a pair is a constant and arrival times
never decrease, so release times never decrease within a pair, and equal release times are
broken by arrival sequence. At most --queue-limit frames wait (netem's default limit is 1000;
ours 10000); a frame arriving at a full queue is dropped and counted. Rate shaping is not done
here: tbf on the veth ends does it (a send the egress qdisc refuses is a tail drop, counted).

The second form turns off the transmit checksum, TSO, GSO and GRO offloads of DEVICE with the
SIOCETHTOOL ioctl (no ethtool binary needed). The testbed runs it on each host's eth0: a veth
hands its peer frames with a partial checksum (CHECKSUM_PARTIAL) and TCP segments of up to
64 KB (GSO), which a packet socket reads as they are and could not send on unchanged: the
receiver would drop the bad checksum, the egress veth refuses frames over its MTU.

Stdlib only: no project imports, runs under any Python >= 3.10. Prints
"switching PORT ..." once every socket is bound, statistics on SIGUSR1 and on exit (SIGTERM or
SIGINT: exit 0).
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import heapq
import os
import random
import re
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

MAC_AGE = 300.0  # seconds a learned MAC stays valid without a frame from it (Linux bridge: 300)
ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_ADD_MEMBERSHIP = 1
PACKET_MR_PROMISC = 1
PACKET_OUTGOING = 4  # sockaddr_ll pkttype of a frame this host sent
PACKET_IGNORE_OUTGOING = 23  # Linux >= 4.20: the socket does not see frames sent on its device
SIOCETHTOOL = 0x8946
# Legacy ethtool "set one feature" commands, each taking a struct ethtool_value {u32 cmd, data}.
ETHTOOL_OFFLOADS = {"tx-checksum": 0x17, "sg": 0x19, "tso": 0x1F, "gso": 0x24, "gro": 0x2C}
BATCH = 64  # frames read from one socket before the others get a turn


# --- the pure core: ports, learning, decisions, the delay line -----------------------------------


class SpecError(ValueError):
    """A port specification that does not parse; the message shows it and what was expected."""


@dataclass(frozen=True, kw_only=True)
class Port:
    """One switch port and the impairment on its link."""

    name: str
    """The network device in the switch's namespace."""
    delay: float
    """One-way delay in seconds, added on the way in from and again on the way out to the port."""
    loss: float
    """Probability (0..1) that a frame is lost, drawn on the way in and again on the way out."""


def parse_port(text: str) -> Port:
    """`NAME=DELAY,LOSS` (e.g. `p2=40ms,0.5%`; DELAY in us, ms or s) or a bare `NAME` (no delay,
    no loss)."""
    name, _, impairment = text.partition("=")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", name):
        raise SpecError(f"port {text!r}: expected NAME=DELAY,LOSS with a device name")
    if not impairment:
        return Port(name=name, delay=0.0, loss=0.0)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s),(\d+(?:\.\d+)?)%", impairment)
    if not m or float(m[3]) > 100:
        raise SpecError(f"port {text!r}: expected NAME=DELAY,LOSS like p2=40ms,0.5%")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m[2]]
    return Port(name=name, delay=float(m[1]) * scale, loss=float(m[3]) / 100)


def is_group(mac: bytes) -> bool:
    """Broadcast or multicast: the I/G bit, the lowest bit of the first octet."""
    return bool(mac[0] & 1)


class MacTable:
    """Which port each source MAC was last seen on, forgotten `age` seconds after."""

    def __init__(self, *, age: float = MAC_AGE) -> None:
        self.age = age
        self._entries: dict[bytes, tuple[int, float]] = {}

    def learn(self, mac: bytes, port: int, now: float) -> None:
        if not is_group(mac):  # a group address as a source is bogus: never learn it
            self._entries[mac] = (port, now)

    def lookup(self, mac: bytes, now: float) -> int | None:
        entry = self._entries.get(mac)
        if entry is None:
            return None
        if now - entry[1] > self.age:
            del self._entries[mac]
            return None
        return entry[0]

    def __len__(self) -> int:
        return len(self._entries)


def egress_ports(table: MacTable, ingress: int, dst: bytes, n_ports: int, now: float) -> list[int]:
    """Where a frame from `ingress` to `dst` goes: its learned port (none if that is where it came
    from), else every port but `ingress` (flooding: group or not yet learned destinations)."""
    port = None if is_group(dst) else table.lookup(dst, now)
    if port is None:
        return [p for p in range(n_ports) if p != ingress]
    return [] if port == ingress else [port]


@dataclass
class Statistics:
    """Counters since the start; `line()` prints them."""

    received: int = 0
    forwarded: int = 0
    flooded: int = 0
    lost: int = 0
    queue_full: int = 0
    oversize: int = 0
    send_refused: int = 0

    def line(self, *, learned: int, queued: int) -> str:
        return (
            f"received {self.received}, forwarded {self.forwarded} (flooded {self.flooded}), "
            f"lost {self.lost} (emulated), dropped: queue full {self.queue_full}, "
            f"oversize {self.oversize}, refused by egress {self.send_refused}; "
            f"{learned} MACs learned, {queued} frames queued"
        )


@dataclass
class Switch:
    """The switch without I/O: `receive` frames with the time they arrived, `due` gives back
    (egress port, frame) pairs whose release time has come, in release order."""

    ports: list[Port]
    rng: random.Random
    queue_limit: int = 10000
    max_frame: int = 1514
    """Longest frame the egress devices take (MTU + 14): longer ones cannot be sent, so they are
    dropped on the way in (counted as oversize)."""
    table: MacTable = field(default_factory=MacTable)
    stats: Statistics = field(default_factory=Statistics)
    _queue: list[tuple[float, int, int, bytes]] = field(default_factory=list)
    _seq: int = 0

    def receive(self, ingress: int, frame: bytes, now: float) -> None:
        self.stats.received += 1
        if len(frame) < 14:
            return
        if len(frame) > self.max_frame:
            self.stats.oversize += 1
            return
        src, dst = frame[6:12], frame[0:6]
        self.table.learn(src, ingress, now)
        inbound = self.ports[ingress]
        if inbound.loss and self.rng.random() < inbound.loss:
            self.stats.lost += 1
            return
        egress = egress_ports(self.table, ingress, dst, len(self.ports), now)
        if len(egress) > 1:
            self.stats.flooded += 1
        for port in egress:
            outbound = self.ports[port]
            if outbound.loss and self.rng.random() < outbound.loss:
                self.stats.lost += 1
                continue
            if len(self._queue) >= self.queue_limit:
                self.stats.queue_full += 1
                continue
            # The sequence number breaks ties in arrival order: FIFO within a (src, dst) pair.
            self._seq += 1
            release = now + inbound.delay + outbound.delay
            heapq.heappush(self._queue, (release, self._seq, port, frame))

    def next_release(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def due(self, now: float) -> list[tuple[int, bytes]]:
        out = []
        while self._queue and self._queue[0][0] <= now:
            _, _, port, frame = heapq.heappop(self._queue)
            out.append((port, frame))
        self.stats.forwarded += len(out)
        return out

    def queued(self) -> int:
        return len(self._queue)

    def statistics_line(self) -> str:
        return self.stats.line(learned=len(self.table), queued=self.queued())


# --- the I/O shell: sockets, poll, signals --------------------------------------------------------


def in_a_bridge(device: str) -> bool:
    """Whether the kernel also switches `device` (a bridge port): frames would be doubled."""
    return os.path.exists(f"/sys/class/net/{device}/brport")


def open_port(device: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind((device, ETH_P_ALL))
    ifindex = socket.if_nametoindex(device)
    # Promiscuous: every frame on the wire, whatever its destination MAC (a veth delivers them
    # anyway; a real NIC would filter). The kernel revokes it when the socket closes.
    mreq = struct.pack("iHH8s", ifindex, PACKET_MR_PROMISC, 0, b"")
    sock.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, mreq)
    with contextlib.suppress(OSError):  # older kernel: recvfrom's pkttype filters them below
        sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    # Room for bursts while Python is busy elsewhere (the kernel caps it at rmem_max; root's
    # SO_RCVBUFFORCE does not).
    for option in (getattr(socket, "SO_RCVBUFFORCE", 33), socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)
            break
        except OSError:
            continue
    sock.setblocking(False)
    return sock


def mtu(device: str) -> int:
    with open(f"/sys/class/net/{device}/mtu") as f:
        return int(f.read())


def serve(switch: Switch) -> int:
    names = [p.name for p in switch.ports]
    for name in names:
        if in_a_bridge(name):
            print(f"impair: {name} is a bridge port; detach it first", file=sys.stderr)
            return 1
    socks = [open_port(name) for name in names]
    switch.max_frame = min(mtu(name) for name in names) + 14
    by_fd = {s.fileno(): i for i, s in enumerate(socks)}

    # Signals only write a byte to a pipe that poll watches: no work in a handler, no busy-wait.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda *_: None)
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    print(f"impair: switching {' '.join(names)}", flush=True)

    while True:
        release = switch.next_release()
        # poll rounds a float timeout in ms up: a frame leaves at or just after its release time.
        timeout = None if release is None else max(0.0, (release - time.monotonic()) * 1000)
        for fd, _ in poller.poll(timeout):
            if fd == wake_r:
                signals = os.read(wake_r, 64)
                if signals.translate(None, bytes([signal.SIGUSR1])):  # SIGTERM or SIGINT
                    print(f"impair: stopped; {switch.statistics_line()}", flush=True)
                    return 0
                print(f"impair: {switch.statistics_line()}", flush=True)
                continue
            port, sock = by_fd[fd], socks[by_fd[fd]]
            for _ in range(BATCH):
                try:
                    frame, address = sock.recvfrom(65536)
                except BlockingIOError:
                    break
                except OSError as e:  # the port went away (its namespace deleted): stop loudly
                    print(f"impair: {names[port]}: {e.strerror}; stopped", file=sys.stderr)
                    print(f"impair: stopped; {switch.statistics_line()}", flush=True)
                    return 1
                if address[2] != PACKET_OUTGOING:
                    switch.receive(port, frame, time.monotonic())
        for port, frame in switch.due(time.monotonic()):
            try:
                socks[port].send(frame)
            except OSError as e:  # ENOBUFS: the egress qdisc (tbf) is full; EAGAIN: sndbuf is
                if e.errno not in (errno.ENOBUFS, errno.EAGAIN, errno.EMSGSIZE):
                    raise
                switch.stats.send_refused += 1


def offloads_off(device: str) -> None:
    """Turn off DEVICE's checksum and segmentation offloads (see the module docstring)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for feature, command in ETHTOOL_OFFLOADS.items():
            value = array.array("I", [command, 0])
            ifreq = struct.pack("16sP", device.encode(), value.buffer_info()[0])
            try:
                fcntl.ioctl(sock, SIOCETHTOOL, ifreq)
            except OSError as e:
                if e.errno != errno.EOPNOTSUPP:
                    raise OSError(e.errno, f"{device}: turning off {feature}: {e.strerror}") from e


def main(argv: list[str]) -> int:
    if argv[:1] == ["offloads-off"] and len(argv) == 2:
        offloads_off(argv[1])
        return 0
    seed, limit, specs = 0, 10000, []
    args = iter(argv)
    for arg in args:
        if arg in ("--seed", "--queue-limit"):
            value = next(args, "")
            if not value.isdigit():
                print(f"impair: {arg} {value!r}: expected a whole number", file=sys.stderr)
                return 2
            seed, limit = (int(value), limit) if arg == "--seed" else (seed, int(value))
        elif arg in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            specs.append(arg)
    try:
        ports = [parse_port(spec) for spec in specs]
    except SpecError as e:
        print(f"impair: {e}", file=sys.stderr)
        return 2
    if len(ports) < 2 or len({p.name for p in ports}) != len(ports):
        print("impair: expected two or more distinct ports (see --help)", file=sys.stderr)
        return 2
    return serve(Switch(ports=ports, rng=random.Random(seed), queue_limit=limit))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
