"""deploy/testbed.sh --nat: peers behind their own NAT router, one network namespace each.

A NATed peer I sits behind `<prefix>rI`: the router holds the peer's switch address outside and
10.200.I.1 inside, masquerades what leaves (eim: plain MASQUERADE, which keeps the source port;
symmetric: --random-fully, a new port per connection) and forwards nothing inwards that no
connection from inside asked for.

The slow tests (root, `ip netns`, `tc` and `iptables`; skipped otherwise) check the plumbing
with small socket scripts run by `ip netns exec` (what the backbone sees of an outgoing
connection, each variant's source ports, inbound connections refused or dropped, the shaping on
the router's outside link, `down` removing the routers) and train a backbone and two NATed
peers together with the testbed's own `start` and `wait`. The backbone aggregates there
(`averaging.backbone_aggregates`, off in the testbed by default): the NATed peers find
themselves unreachable by the backbone's dial-back and run client-only, so without it nobody
could reduce. The peer ids are chosen (keys written before `up`): with the backbone's lowest,
and with a NATed peer's lowest (a member that cannot be dialled never leads a group:
`matchmaking.leader_candidates`; before, each NATed peer led a group of one for a whole run).
Every subprocess has a timeout; a fixture runs `down` and kills by PID what it missed. No timed
assertions: the machine is shared.

The fast tests need neither root nor namespaces: the option's help and its argument errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.test_testbed import Bed, script

ROOT = Path(__file__).resolve().parent.parent
SUBNET = "10.68.0"
STEPS = 5
PORT = 5001


def _has_netns() -> bool:
    if not shutil.which("ip"):
        return False
    try:
        return (
            subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=10).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


CAN_RUN = (
    sys.platform == "linux"
    and os.geteuid() == 0
    and shutil.which("tc") is not None
    and shutil.which("iptables") is not None
    and _has_netns()
)
needs_root = pytest.mark.skipif(
    not CAN_RUN, reason="needs Linux, root, `ip netns`, tc and iptables (NAT routers)"
)


# --- fast: no root needed -------------------------------------------------------------------


def test_help_documents_the_nat_option():
    result = script("--help", timeout=10)
    assert result.returncode == 0, result.stderr
    for word in ("--nat", "eim", "symmetric", "<prefix>rI", "TESTBED_NAT"):
        assert word in result.stdout, word


@pytest.mark.parametrize(
    ("nat", "expected"),
    [
        ("p1=full-cone", "--nat entry p1=full-cone: expected pI=eim or pI=symmetric"),
        ("bb=eim", "--nat entry bb=eim: expected pI=eim or pI=symmetric"),
        ("p0=eim", "--nat entry p0=eim: expected"),
        ("p1=eim,p1=symmetric", "--nat names p1 twice"),
        ("p1=eim p2=eim p2=symmetric", "--nat names p2 twice"),
    ],
)
def test_bad_nat_entries_are_one_line_with_exit_1(nat, expected, tmp_path):
    result = script("--run-dir", str(tmp_path / "run"), "--nat", nat, "up", "2", timeout=10)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


def test_a_subnet_among_the_routers_inside_networks_is_refused(tmp_path):
    where = ["--run-dir", str(tmp_path / "run"), "--subnet", "10.200.3.0/24"]
    result = script(*where, "--nat", "p1=eim", "down", timeout=10)
    assert result.returncode == 1 and "not in 10.200.0.0/16" in result.stderr, result.stderr
    assert script(*where, "down", timeout=10).returncode == 0  # without --nat it is fine


# --- slow: routers, a real collaboration ----------------------------------------------------


@dataclass
class NatBed(Bed):
    """`test_testbed.Bed` under its own prefix and subnet, with the socket servers this test
    starts in the namespaces, killed first on teardown."""

    prefix: str = field(default_factory=lambda: f"ptn{uuid.uuid4().hex[:6]}-")
    subnet: str = SUBNET
    helpers: list[subprocess.Popen] = field(default_factory=list)

    def teardown(self) -> None:
        for helper in self.helpers:
            if helper.poll() is None:
                helper.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                helper.wait(timeout=10)
        super().teardown()


@pytest.fixture
def bed(tmp_path):
    testbed = NatBed(tmp_path / "run")
    try:
        yield testbed
    finally:
        testbed.teardown()


def switch_ip(host: str) -> str:
    """A host's address on the switch: a NATed peer's is its router's outside address."""
    return f"{SUBNET}.1" if host == "bb" else f"{SUBNET}.{int(host[1:]) + 1}"


# `server PORT`: prints "listening", then answers every connection with "IP PORT" of its peer as
# it sees it. `client LOCAL_PORT TIMEOUT IP:PORT...`: one connection to each destination in turn,
# all from LOCAL_PORT (0: any; SO_REUSEADDR, so several connections to different destinations
# share it) and all held open until the end, so the NAT maps them side by side; prints a JSON
# list, per destination {"seen": [ip, port]} or {"error": "ECONNREFUSED" | "timeout" | ...}.
SOCKETS = r"""
import errno, json, socket, sys
if sys.argv[1] == "server":
    listener = socket.create_server(("0.0.0.0", int(sys.argv[2])))
    print("listening", flush=True)
    while True:
        conn, (ip, port) = listener.accept()
        conn.sendall(f"{ip} {port}".encode())
        conn.close()
local, timeout, results, held = int(sys.argv[2]), float(sys.argv[3]), [], []
for dest in sys.argv[4:]:
    ip, port = dest.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", local))
    sock.settimeout(timeout)
    try:
        sock.connect((ip, int(port)))
        seen_ip, seen_port = sock.recv(64).decode().split()
        results.append({"seen": [seen_ip, int(seen_port)]})
    except TimeoutError:
        results.append({"error": "timeout"})
    except OSError as error:
        results.append({"error": errno.errorcode.get(error.errno, repr(error))})
    held.append(sock)
print(json.dumps(results))
"""


def serve(bed: NatBed, host: str) -> None:
    """A SOCKETS server on PORT in `host`'s namespace, until teardown (killed by PID)."""
    server = subprocess.Popen(
        ["ip", "netns", "exec", bed.ns(host), sys.executable, "-c", SOCKETS, "server", str(PORT)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    bed.helpers.append(server)
    assert server.stdout is not None
    ready, _, _ = select.select([server.stdout], [], [], 30)
    line = server.stdout.readline() if ready else ""
    assert line == "listening\n", (host, line, server.poll())


def connect(
    bed: NatBed, host: str, *destinations: str, local_port: int = 0, timeout: float = 3.0
) -> list[dict]:
    """SOCKETS client results, from `host`'s namespace to each `IP:PORT` in turn."""
    result = subprocess.run(
        ["ip", "netns", "exec", bed.ns(host), sys.executable, "-c", SOCKETS, "client",
         str(local_port), str(timeout), *destinations],
        capture_output=True, text=True, timeout=30 + timeout * len(destinations),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def addresses(namespace: str) -> dict[str, str]:
    """Device -> its IPv4 address/prefix in `namespace`."""
    out = subprocess.run(
        ["ip", "-n", namespace, "-o", "-4", "addr", "show"],
        capture_output=True, text=True, timeout=10, check=True,
    ).stdout  # fmt: skip
    return {line.split()[1]: line.split()[3] for line in out.splitlines() if " lo " not in line}


def root_qdisc(namespace: str, device: str) -> tuple[str, str]:
    """The kind of `device`'s root qdisc and its whole line, as `tc qdisc show` prints it."""
    out = subprocess.run(
        ["tc", "-n", namespace, "qdisc", "show", "dev", device],
        capture_output=True, text=True, timeout=10, check=True,
    ).stdout  # fmt: skip
    line = next(line for line in out.splitlines() if " root " in line)
    return line.split()[1], line


def nat_rules(bed: NatBed, router: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", bed.ns(router), "iptables-save"],
        capture_output=True, text=True, timeout=10, check=True,
    ).stdout  # fmt: skip


@pytest.mark.slow
@needs_root
def test_nat_routers_masquerade_outbound_and_let_nothing_in(bed):
    # p1 behind an endpoint-independent NAT, p2 behind a symmetric one, p3 on the switch.
    shapes = "50mbit,10ms,0% 20mbit,20ms,0% -"
    up = bed("--nat", "p1=eim,p2=symmetric", "--shapes", shapes, "up", "3")
    assert up.returncode == 0, up.stderr
    hosts = ("sw", "bb", "p1", "p2", "p3", "r1", "r2")
    assert bed.namespaces() == {bed.ns(h) for h in hosts}
    state = (bed.run_dir / "state").read_text()
    assert f"p1={SUBNET}.2 via eim NAT (p1 at 10.200.1.2)" in state, state
    assert f"p2={SUBNET}.3 via symmetric NAT (p2 at 10.200.2.2)" in state, state

    # Addresses: the peer private, its router the peer's old switch address outside.
    assert addresses(bed.ns("p1")) == {"eth0": "10.200.1.2/24"}
    assert addresses(bed.ns("r1")) == {"lan0": "10.200.1.1/24", "eth0": f"{SUBNET}.2/24"}
    assert addresses(bed.ns("p3")) == {"eth0": f"{SUBNET}.4/24"}
    # The rules: MASQUERADE (--random-fully for symmetric), inbound only what was asked for.
    eim, symmetric = nat_rules(bed, "r1"), nat_rules(bed, "r2")
    assert "-A POSTROUTING -o eth0 -j MASQUERADE\n" in eim, eim
    assert "-A POSTROUTING -o eth0 -j MASQUERADE --random-fully" in symmetric, symmetric
    for rules in (eim, symmetric):
        assert ":FORWARD DROP" in rules and "--ctstate RELATED,ESTABLISHED -j ACCEPT" in rules
    # Shaping: on the router's outside link (upload) and the switch port (download), at the
    # peer's rate; the peer's own link to its router is not shaped.
    for host, router, rate in (("p1", "r1", "50Mbit"), ("p2", "r2", "20Mbit")):
        for namespace, device in ((bed.ns(router), "eth0"), (bed.ns("sw"), host)):
            kind, line = root_qdisc(namespace, device)
            assert kind in ("netem", "tbf") and f"rate {rate}" in line, line
        assert root_qdisc(bed.ns(host), "eth0")[0] == "noqueue"

    for host in ("bb", "p3", "p1"):
        serve(bed, host)
    backbone, plain = f"{switch_ip('bb')}:{PORT}", f"{switch_ip('p3')}:{PORT}"

    # Outbound works, and the far end sees the router's address. eim: two connections from
    # one local port to two destinations keep that port on the way out.
    seen_eim = connect(bed, "p1", backbone, plain, local_port=40123)
    assert seen_eim == [{"seen": [switch_ip("p1"), 40123]}] * 2, seen_eim
    # Symmetric: the same two connections leave from two different ports.
    seen_sym = connect(bed, "p2", backbone, plain, local_port=40123)
    assert [s.get("seen", [None])[0] for s in seen_sym] == [switch_ip("p2")] * 2, seen_sym
    assert seen_sym[0]["seen"][1] != seen_sym[1]["seen"][1], seen_sym

    # Inbound fails: p1 listens on PORT (its router reaches it: the control), but from outside
    # the router's address drops it (no reset, as a home router), and the private address is
    # unroutable, or dropped by the router once the backbone is told to route 10.200.1.0/24
    # through it.
    outside, private = f"{switch_ip('p1')}:{PORT}", f"10.200.1.2:{PORT}"
    control = connect(bed, "r1", private)
    assert control[0].get("seen", [None])[0] == "10.200.1.1", control
    from_outside = connect(bed, "bb", outside, private)
    assert from_outside == [{"error": "timeout"}, {"error": "ENETUNREACH"}], from_outside
    subprocess.run(
        ["ip", "-n", bed.ns("bb"), "route", "add", "10.200.1.0/24", "via", switch_ip("p1")],
        check=True, timeout=10,
    )  # fmt: skip
    routed = connect(bed, "bb", private)
    assert routed == [{"error": "timeout"}], routed
    assert connect(bed, "p3", outside) == [{"error": "timeout"}]
    assert connect(bed, "p2", outside) == [{"error": "timeout"}]  # NAT to NAT: no way in
    print(f"\neim p1 -> bb, p3: {seen_eim}; symmetric p2 -> bb, p3: {seen_sym}")
    print(f"bb -> p1 outside, private: {from_outside}; routed private: {routed}")

    down = bed("down")
    assert down.returncode == 0, down.stderr
    assert bed.ns("r1") in down.stderr and bed.ns("r2") in down.stderr, down.stderr
    assert bed.namespaces() == set()
    bed.read_pids()
    assert bed.ours_alive() == []


def write_keys(run_dir: Path, order: tuple[str, ...]) -> dict[str, str]:
    """Identity keys (raw Ed25519 seeds, as `peer.net.identity` keeps them) for the hosts in
    `order`, whose peer ids sort in that order; `up` keeps keys. Returns host -> peer id."""
    from libp2p.crypto.ed25519 import Ed25519PrivateKey
    from libp2p.peer.id import ID

    seeds = [os.urandom(32) for _ in order]
    ids = {
        seed: ID.from_pubkey(Ed25519PrivateKey.from_bytes(seed).get_public_key()).to_base58()
        for seed in seeds
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    chosen = {}
    for host, seed in zip(order, sorted(seeds, key=ids.__getitem__), strict=True):
        path = run_dir / f"{host}.key"
        path.write_bytes(seed)
        path.chmod(0o600)
        chosen[host] = ids[seed]
    return chosen


def log_records(bed: NatBed, host: str) -> list[dict]:
    records = []
    path = bed.run_dir / f"{host}.log"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


def verdict(bed: NatBed, host: str) -> str | None:
    """What `host` last logged of its own reachability (its link measurement), if anything."""
    said = None
    for record in log_records(bed, host):
        if record.get("logger") == "peertrain.measure" and record["msg"].startswith("link: "):
            said = record["msg"].rsplit(", ", 1)[-1]
    return said


CLIENT_ONLY = "client-only (not reachable inbound)"
PUNCHABLE = "reachable by hole punching (its NAT keeps its address)"


@dataclass
class Training:
    """What a NATed collaboration showed."""

    waited: subprocess.CompletedProcess[str]
    verdicts: dict[str, str]
    """Each peer's own reachability verdict, from its log."""
    client_only: dict[str, bool | None]
    """The backbone's view (`status --json`) while they trained, by peer id."""
    figures: dict[str, dict]
    """Each peer's `training finished` figures, where it logged them."""
    failed: dict[str, int]
    """Averaging attempts each peer logged as not completed."""
    reduced: list[str]
    """The percentage of the vector the backbone reduced in each averaging it aggregated in."""

    def summary(self) -> str:
        averaged = {h: f["averaged_bytes"] for h, f in self.figures.items()}
        return (
            f"verdicts {self.verdicts}; status client_only {self.client_only}; averaged bytes "
            f"{averaged}; failed averaging attempts {self.failed}; the backbone reduced "
            f"{self.reduced} % of the vector; wait said {self.waited.stdout.strip()!r}"
        )


def train_behind_nat(
    bed: NatBed,
    kinds: tuple[str, str],
    order: tuple[str, ...],
    wait: int,
    *,
    backbone_aggregates: bool = True,
    env: dict[str, str] | None = None,
) -> Training:
    """A backbone and p1, p2 behind NATs of `kinds`, with peer ids sorted in `order`: `up`,
    `start`, the peers' verdicts, `wait` (at most `wait` seconds), what the logs say. With
    `backbone_aggregates` the backbone joins every averaging to reduce; `env`: more settings."""
    ids = write_keys(bed.run_dir, order)
    nat = f"p1={kinds[0]},p2={kinds[1]}"
    up = bed("--nat", nat, "--shapes", "50mbit,10ms,0% 20mbit,20ms,0%", "up", "2")
    assert up.returncode == 0, up.stderr
    assert bed.namespaces() == {bed.ns(h) for h in ("sw", "bb", "p1", "p2", "r1", "r2")}

    # Where every peer is client-only, nobody but the backbone can reduce.
    env = {
        "PEERTRAIN_AVERAGING_BACKBONE_AGGREGATES": str(backbone_aggregates).lower(),
        **(env or {}),
    }
    start = bed("--max-steps", str(STEPS), "start", env=env, timeout=300)
    bed.read_pids()
    assert start.returncode == 0, start.stderr
    joined = re.findall(r"(p\d) joined at ([\d.]+) as (\w+)", start.stderr)
    expected = [(h, switch_ip(h), ids[h]) for h in ("p1", "p2")]  # the router's address
    assert sorted(joined) == expected, start.stderr
    assert f"backbone /ip4/{switch_ip('bb')}/tcp/31337/p2p/{ids['bb']}" in start.stderr

    # Each NATed peer's own verdict (after its first link measurement and dial-back: the
    # compute measurement before it waits up to 120 s for enough training), and the backbone's
    # view of them while they still train.
    deadline, verdicts = time.monotonic() + 400, {}
    while time.monotonic() < deadline and len(verdicts) < 2 and bed.ours_alive():
        verdicts = {h: v for h in ("p1", "p2") if (v := verdict(bed, h)) is not None}
        time.sleep(2)
    client_only: dict[str, bool | None] = {}
    status = bed("status", "--json", timeout=60)
    if status.returncode == 0:
        for row in json.loads(status.stdout)["peers"]:
            if row["role"] == "peer":
                host = next((h for h, i in ids.items() if i == row["peer_id"]), row["peer_id"])
                client_only[host] = row.get("client_only")

    waited = bed("--timeout", str(wait), "wait", timeout=wait + 60)
    figures = {}
    for host in ("p1", "p2"):
        finished = [r["training"] for r in log_records(bed, host) if "training" in r]
        if finished:
            figures[host] = finished[-1]
    failed = {
        h: sum("did not complete" in r["msg"] for r in log_records(bed, h)) for h in ("p1", "p2")
    }
    reduced = [
        m[1]
        for r in log_records(bed, "bb")
        if (m := re.match(r"aggregated ([\d.]+)% of epoch", r["msg"]))
    ]
    return Training(waited, verdicts, client_only, figures, failed, reduced)


def down_leaves_nothing(bed: NatBed) -> None:
    down = bed("down")
    assert down.returncode == 0, down.stderr
    assert bed.namespaces() == set() and bed.ours_alive() == []


@pytest.mark.slow
@needs_root
@pytest.mark.parametrize(
    "kinds", [("eim", "symmetric"), ("symmetric", "symmetric")], ids=["eim+sym", "sym+sym"]
)
def test_two_natted_peers_train_client_only_through_the_backbone(bed, kinds):
    # The backbone's peer id sorts first: it leads every group (see the test after this one).
    seen = train_behind_nat(bed, kinds, order=("bb", "p1", "p2"), wait=600)
    print(f"\nNAT {kinds}, backbone's id lowest: {seen.summary()}")
    waited = seen.waited
    assert waited.returncode == 0, (waited.stdout, waited.stderr)
    assert waited.stdout.split("\n")[:2] == [f"p{i} finished at step {STEPS}" for i in (1, 2)]
    # Behind NAT the backbone's dial-back fails. p1's eim NAT keeps its announced address, so
    # peers could punch through to it, but not p2 behind a symmetric one: with p2 in the
    # group, neither reduces. Both average through the backbone, which reduces the whole
    # vector of every step that completed.
    eim = {"p1": PUNCHABLE} if kinds[0] == "eim" else {"p1": CLIENT_ONLY}
    assert seen.verdicts == {**eim, "p2": CLIENT_ONLY}, seen.verdicts
    assert seen.client_only.get("p2") is not False, seen.client_only
    # (None: the backbone's status ran before the peer's record showed a verdict.)
    assert seen.client_only.get("p1") in (kinds[0] == "symmetric", None), seen.client_only
    for host in ("p1", "p2"):
        figures = seen.figures.get(host)
        assert figures is not None and figures["step"] == STEPS, (host, figures)
        assert figures["averaged_bytes"] > 0, (host, figures)
    assert seen.reduced.count("100.0") >= STEPS, seen.reduced
    down_leaves_nothing(bed)


@pytest.mark.slow
@needs_root
def test_two_natted_peers_train_when_a_natted_peer_has_the_lowest_id(bed):
    seen = train_behind_nat(bed, ("symmetric", "symmetric"), order=("p1", "p2", "bb"), wait=400)
    print(f"\nNAT symmetric both, p1's id lowest: {seen.summary()}")
    try:
        assert seen.verdicts == {"p1": CLIENT_ONLY, "p2": CLIENT_ONLY}, seen.verdicts
        assert seen.waited.returncode == 0, (seen.waited.stdout, seen.waited.stderr)
        for host in ("p1", "p2"):
            figures = seen.figures.get(host)
            assert figures is not None and figures["step"] == STEPS, (host, figures)
    finally:
        down_leaves_nothing(bed)


@pytest.mark.slow
@needs_root
def test_two_natted_peers_behind_eim_nats_aggregate_after_hole_punching(bed):
    """Both NATs keep their peer's announced address (the mapping check): the peers reduce
    halves of the vector for each other, with no backbone to reduce, over the direct
    connection a hole punch made (no data address of theirs can be dialled)."""
    # Parts are whole chunks: small ones, or the tiny model's vector is one part, one reducer.
    chunks = {"PEERTRAIN_AVERAGING_CHUNK_ELEMENTS": "1024"}
    seen = train_behind_nat(bed, ("eim", "eim"), order=("bb", "p1", "p2"), wait=600,
                            backbone_aggregates=False, env=chunks)  # fmt: skip
    print(f"\nNAT eim both, no backbone aggregating: {seen.summary()}")
    try:
        assert seen.verdicts == {"p1": PUNCHABLE, "p2": PUNCHABLE}, seen.verdicts
        assert seen.client_only.get("p1") is False and seen.client_only.get("p2") is False
        assert seen.waited.returncode == 0, (seen.waited.stdout, seen.waited.stderr)
        assert seen.reduced == [], seen.reduced  # the backbone reduced nothing
        for host in ("p1", "p2"):
            figures = seen.figures.get(host)
            assert figures is not None and figures["step"] == STEPS, (host, figures)
            assert figures["reducing"] >= STEPS - 1, (host, figures)
            assert figures["stream_senders"] >= STEPS - 1, (host, figures)
    finally:
        down_leaves_nothing(bed)


def spawn(bed: NatBed, host: str, *args: str) -> tuple[subprocess.Popen, str]:
    """`python -m tests.nat_holepunch ARGS` in `host`'s namespace (killed on teardown) and the
    first line it prints."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", bed.ns(host), sys.executable, "-m", "tests.nat_holepunch", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    bed.helpers.append(proc)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline().strip() if ready else ""
    assert line, (host, proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
    return proc, line


@pytest.mark.slow
@needs_root
@pytest.mark.parametrize(("kind", "direct"), [("eim", True), ("symmetric", False)])
def test_two_natted_peers_punch_a_direct_connection_unless_both_nats_are_symmetric(
    bed, kind, direct
):
    """p1 and p2 behind their own NAT routers (both `kind`), a relay on the backbone's host:
    p2 reaches p1 through the relay, then both dial each other from their listen port
    (peer.net.holepunch). Behind eim NATs the SYNs meet (simultaneous open) and the
    connection is direct, between the routers' outside addresses; behind symmetric NATs
    every dial leaves from a new port, nothing meets, and they stay on the relay."""
    up = bed(
        "--nat", f"p1={kind},p2={kind}", "--shapes", "50mbit,10ms,0% 20mbit,20ms,0%", "up", "2"
    )
    assert up.returncode == 0, up.stderr
    _, relay = spawn(bed, "bb", "relay", switch_ip("bb"))
    _, relayed = spawn(bed, "p1", "nated", switch_ip("p1"), relay)
    assert "/p2p-circuit/p2p/" in relayed, relayed
    dialer, line = spawn(bed, "p2", "dialer", switch_ip("p2"), relayed)
    summary = json.loads(line)
    print(f"\nNAT {kind} both: {summary}")
    assert summary["echo"] == "hi", summary  # the call works either way
    assert summary["outcome"] is direct, summary
    if direct:
        # Aimed at p1's router, port 4001: the mapping of p1's dial from its listen port.
        assert summary["direct_to"] == [switch_ip("p1"), 4001], summary
        assert summary["relayed_conns"] == [False], summary  # the relayed one closed
    else:
        assert summary["direct_to"] is None and summary["relayed_conns"] == [True], summary
    dialer.wait(timeout=30)
    down_leaves_nothing(bed)
