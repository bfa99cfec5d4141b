"""Private collaborations (issue 7): a network key admits only the machines that hold it.

In process: a member with the key runs the DHT and the averaging and state RPC services; an
insider (same key) stores records and reaches every service, an outsider (no key) and an
impostor (another key) can neither write a record, nor reach the group-join or state services.
Through the CLI: a keyed backbone and peer; `peer status` and `peer join` without the key get
one line saying what to do.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from contextlib import AsyncExitStack

import msgspec
import pytest
import trio

from peer.averaging.matchmaking import SERVICE as GROUP_SERVICE
from peer.config import DhtConfig
from peer.dht.node import DHT
from peer.errors import IdentityError, RemoteError, RpcError
from peer.net.host import open_node
from peer.net.network_key import create_network_key, load_network_key
from peer.net.rpc import RpcServer
from peer.training.chunks import SERVICE as STATE_SERVICE
from tests.helpers import LOOPBACK, new_identity
from tests.test_cli_e2e import ENV, ROOT, procs  # noqa: F401 (procs is a fixture)

# ---------------------------------------------------------------------------- the key file


def test_a_made_key_is_private_and_loads(tmp_path):
    path = tmp_path / "keys" / "net.key"
    create_network_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = load_network_key(str(path))
    assert key is not None and len(bytes.fromhex(key)) == 32
    assert load_network_key(str(path)) == key
    assert load_network_key("") is None
    with pytest.raises(IdentityError, match="exists"):
        create_network_key(path)  # never overwrites the key every member holds
    assert load_network_key(str(path)) == key


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [
        ("00" * 32, 0o644, "chmod 600"),
        ("00" * 31, 0o600, "malformed"),
        ("zz" * 32, 0o600, "malformed"),
        (None, 0o600, "cannot read"),
    ],
)
def test_a_bad_key_file_is_one_clear_error(tmp_path, content, mode, message):
    path = tmp_path / "net.key"
    if content is not None:
        path.write_text(content)
        os.chmod(path, mode)
    with pytest.raises(IdentityError, match=message):
        load_network_key(str(path))


# ---------------------------------------------------------------------------- in process


class Ping(msgspec.Struct):
    text: str


async def test_only_holders_of_the_key_write_records_and_reach_the_services(tmp_path):
    keys = {}
    for name in ("ours", "theirs"):
        create_network_key(tmp_path / name)
        keys[name] = load_network_key(str(tmp_path / name))
    config = DhtConfig()
    async with AsyncExitStack() as stack:

        async def node(key):
            return await stack.enter_async_context(
                open_node(
                    new_identity(), listen=[LOOPBACK], announce=[], max_message_bytes=1 << 20,
                    network_key=key,
                )
            )  # fmt: skip

        member_node = await node(keys["ours"])
        nursery = await stack.enter_async_context(trio.open_nursery())  # closes before the node
        member = DHT(member_node, config, server=True, rpc_timeout=3.0)
        await nursery.start(member.run)
        answered: list[str] = []
        for service in (GROUP_SERVICE, STATE_SERVICE):  # stand-ins for join and manifest
            server = RpcServer(member_node.host, service, max_message_bytes=1 << 20)

            async def ping(caller, request, service=service):
                answered.append(service)
                return request

            server.add_unary("ping", Ping, ping)
        seed = [(member_node.peer_id, member_node.announce[0])]

        insider = DHT(await node(keys["ours"]), config, server=False, rpc_timeout=3.0)
        assert await insider.bootstrap(seed) == [member_node.peer_id]
        assert await insider.store("k", "insider", b"v", expiration=time.time() + 60) == 1
        for service in (GROUP_SERVICE, STATE_SERVICE):
            reply = await insider.node.rpc.call(
                member_node.peer_id, service, "ping", Ping(service), Ping, timeout=5
            )
            assert reply.text == service
        assert answered == [GROUP_SERVICE, STATE_SERVICE]

        for name, key in (("outsider", None), ("impostor", keys["theirs"])):
            stranger = DHT(await node(key), config, server=False, rpc_timeout=3.0)
            assert await stranger.bootstrap(seed) == [], name
            stranger.node.remember_addrs(member_node.peer_id, [member_node.announce[0]])
            stored = await stranger.store("k", name, b"v", expiration=time.time() + 60)
            assert stored == 0, name
            for service in (GROUP_SERVICE, STATE_SERVICE):
                with pytest.raises(RemoteError) as caught:
                    await stranger.node.rpc.call(
                        member_node.peer_id, service, "ping", Ping(name), Ping, timeout=5
                    )
                assert not isinstance(caught.value, RpcError)  # no answer, not an error answer
        assert answered == [GROUP_SERVICE, STATE_SERVICE]  # no stranger reached a handler
        assert set(member.records.get("k", now=time.time())) == {"insider"}
        assert set(await insider.get("k")) == {"insider"}
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------- through the CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


# About a minute of real processes: with -m slow (CI's 15 min budget); the in-process tests
# above cover who the key admits on every call.
@pytest.mark.slow
def test_a_private_backbone_admits_only_peers_with_its_key(procs, tmp_path):  # noqa: F811
    key = tmp_path / "collab.key"
    made = run_cli("cli.backbone_cli", "network-key", str(key))
    assert made.returncode == 0, made.stderr
    backbone = procs(
        "cli.backbone_cli", "start", "--identity", str(tmp_path / "bb.key"),
        "--listen", LOOPBACK, "--network-key", str(key),
    )  # fmt: skip
    line = backbone.wait_line("peer join --backbone /ip4/127.0.0.1/", timeout=30)
    addr = line.split("--backbone ", 1)[1].strip()

    peer = procs(
        "cli.peer_cli", "join", "--identity", str(tmp_path / "p.key"), "--listen", LOOPBACK,
        "--backbone", addr, "--network-key", str(key),
    )  # fmt: skip
    peer_id = peer.wait_line(" joined collaboration", timeout=30).split()[1]

    keyed = run_cli(
        "cli.peer_cli", "status", "--json", "--backbone", addr, "--network-key", str(key)
    )
    assert keyed.returncode == 0, keyed.stderr
    assert peer_id in keyed.stdout

    for args in (
        ("cli.peer_cli", "status", "--backbone", addr),
        ("cli.peer_cli", "join", "--identity", str(tmp_path / "q.key"), "--listen", LOOPBACK,
         "--backbone", addr),
    ):  # fmt: skip
        refused = run_cli(*args)
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "--network-key" in lines[0], refused.stderr
        assert "Traceback" not in refused.stderr
    assert backbone.popen.poll() is None and peer.popen.poll() is None


async def test_garbage_before_the_handshake_does_not_stop_a_private_node(tmp_path):
    create_network_key(tmp_path / "net.key")
    key = load_network_key(str(tmp_path / "net.key"))
    async with AsyncExitStack() as stack:
        member = await stack.enter_async_context(
            open_node(
                new_identity(), listen=[LOOPBACK], announce=[], max_message_bytes=1 << 20,
                network_key=key,
            )
        )  # fmt: skip
        port = int(str(member.announce[0]).split("/tcp/")[1])
        for payload in (b"", b"abc", b"x" * 8, b"y" * 200, os.urandom(5000)):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(payload)  # a short nonce, a wrong key's bytes, noise
            await trio.sleep(0.1)
            await stream.aclose()
        insider = await stack.enter_async_context(
            open_node(
                new_identity(), listen=[], announce=[], max_message_bytes=1 << 20,
                network_key=key,
            )
        )  # fmt: skip
        with trio.fail_after(10):
            await insider.connect(member.peer_id, member.announce, timeout=5)
