"""The data planes' TLS (`peer.net.tls`) and admission (`peer.net.admission`), in process."""

from __future__ import annotations

import datetime
import secrets

import pytest
import trio
import trio.testing
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from peer.errors import ProtocolError
from peer.net.admission import (
    Admission,
    AdmissionLimits,
    check_dial_address,
    connect,
    prove_network_key,
)
from peer.net.tls import TlsStream, certificate_peer_id, pinned_client_context
from tests.helpers import data_identity, new_identity


def plain_certificate() -> bytes:
    """A well-formed self-signed certificate without the libp2p extension."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])
    day = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(1)
        .not_valid_before(day).not_valid_after(day.replace(year=2200))
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return certificate.public_bytes(serialization.Encoding.DER)


def test_a_certificate_names_the_peer_whose_key_signed_it_and_nothing_else_passes():
    identity = new_identity()
    ours = data_identity(identity)
    assert certificate_peer_id(ours.certificate) == identity.peer_id.to_base58()
    for bad in (b"", b"\x30\x82" + secrets.token_bytes(500), plain_certificate()):
        with pytest.raises(ProtocolError, match="does not check out"):
            certificate_peer_id(bad)
    with pytest.raises(ProtocolError, match="limit"):
        certificate_peer_id(bytes(5000))
    # The extension signs the certificate's own key: moving it to another key breaks it.
    flipped = bytearray(ours.certificate)
    flipped[-10] ^= 1  # inside the self-signature
    with pytest.raises(ProtocolError):
        certificate_peer_id(bytes(flipped))


async def socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    left, right = trio.socket.socketpair()
    return trio.SocketStream(left), trio.SocketStream(right)


async def handshake_pair(server_context, client_context) -> tuple[TlsStream, TlsStream]:
    left, right = await socket_pair()
    server = TlsStream(left, server_context, server_side=True)
    client = TlsStream(right, client_context, server_side=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handshake)
        nursery.start_soon(client.handshake)
    return server, client


async def test_mutual_tls_needs_a_trusted_certificate_on_both_ends():
    a, b, stranger = (data_identity(new_identity()) for _ in range(3))
    a.trust([b.certificate])
    b.trust([a.certificate])
    with trio.fail_after(10):
        server, client = await handshake_pair(a.server, b.client)
        assert server.peer_certificate() == b.certificate
        assert client.peer_certificate() == a.certificate
        # A client whose certificate the server never trusted is refused.
        stranger.trust([a.certificate])
        with pytest.raises(BaseExceptionGroup) as caught:
            await handshake_pair(a.server, stranger.client)
        assert caught.group_contains(ProtocolError, match="handshake failed")
        # A server whose certificate the client did not pin is refused.
        with pytest.raises(BaseExceptionGroup) as caught:
            await handshake_pair(stranger.open_server, pinned_client_context([b.certificate]))
        assert caught.group_contains(ProtocolError, match="handshake failed")


async def test_a_restarted_peers_new_certificate_is_not_shadowed_by_its_old_one():
    """OpenSSL tries only the first trusted certificate of a subject: subjects name the key,
    so a peer restarted with the same identity (a new certificate) still gets through to a
    peer that trusted its old one first (before, every handshake between them failed)."""
    identity = new_identity()
    old, new, other = (
        data_identity(identity),
        data_identity(identity),
        data_identity(new_identity()),
    )
    other.trust([old.certificate, new.certificate])
    new.trust([other.certificate])
    with trio.fail_after(10):
        server, _ = await handshake_pair(other.server, new.client)
        assert server.peer_certificate() == new.certificate


async def test_both_directions_stream_at_once_without_deadlock():
    """A writer blocked on a full socket must not keep a reader on the same connection from
    reading (both ends reading only after their writers finished hung a round)."""
    a, b = data_identity(new_identity()), data_identity(new_identity())
    a.trust([b.certificate])
    b.trust([a.certificate])
    left, right = await socket_pair()
    ends = [
        TlsStream(left, a.server, server_side=True),
        TlsStream(right, b.client, server_side=False),
    ]
    size = 64 << 20  # far beyond the sockets' buffers: both writers block while both read
    got = [0, 0]

    async def pump(i: int) -> None:
        async def send() -> None:
            await ends[i].send_all(bytes(size))

        async def receive() -> None:
            buffer = memoryview(bytearray(1 << 16))
            while got[i] < size:
                got[i] += await ends[i].receive_into(buffer)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            nursery.start_soon(receive)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ends[0].handshake)
            nursery.start_soon(ends[1].handshake)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, 0)
            nursery.start_soon(pump, 1)
    assert got == [size, size]


# ---------------------------------------------------------------------------- admission


class FakeSocket:
    def __init__(self, address: str) -> None:
        self.address = address

    def getpeername(self) -> tuple[str, int]:
        return self.address, 1


class FakeStream:
    def __init__(self, address: str) -> None:
        self.socket = FakeSocket(address)


async def test_unauthenticated_slots_are_shared_per_prefix_and_a_newcomer_makes_room():
    admission = Admission(None, AdmissionLimits(max_total=4, max_per_prefix=3, deadline=3.0))
    with (
        admission.slot(FakeStream("10.0.0.1")) as a1,
        admission.slot(FakeStream("10.0.0.2")) as a2,
        admission.slot(FakeStream("10.0.0.3")) as a3,
    ):
        with admission.slot(FakeStream("10.0.0.4")) as a4:  # a 4th from one /24: its oldest goes
            assert a4 is not None and a1.cancel_called and not a2.cancel_called
            assert admission.statistics() == (3, 1)
        with admission.slot(FakeStream("10.0.1.1")) as b1:
            assert b1 is not None and admission.statistics() == (3, 2)
            with admission.slot(FakeStream("10.0.2.1")) as c1:
                assert c1 is not None and admission.statistics() == (4, 3)
                with admission.slot(FakeStream("10.0.3.1")) as d1:  # full: the busiest loses one
                    assert d1 is not None and a2.cancel_called and not a3.cancel_called
                    with admission.slot(FakeStream("10.0.1.2")) as b2:
                        assert b2 is None  # holds one as does everyone: refused
    assert admission.statistics() == (0, 0)


async def serve_data_port(admission: Admission, identity, nursery: trio.Nursery) -> int:
    """A data port on 127.0.0.1 admitting with `admission` (TLS without client certificates,
    the first message one byte); its port. Admitted connections get b"ok" back."""

    async def greet(tls: TlsStream) -> bytes | None:
        return await tls.receive_some(1) or None

    async def handle(stream: trio.SocketStream) -> None:
        admitted = await admission.accept(stream, identity.open_server, greet)
        if admitted is not None:
            async with admitted[0] as tls:
                await tls.send_all(b"ok")

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    return listeners[0].socket.getsockname()[1]


async def test_idle_connections_from_a_members_address_do_not_keep_its_data_connection_out():
    """An attacker on a member's public address (here its own 127.0.0.1) holds every slot of
    that address with connections that never send a byte. Keyed on the exact address with no
    eviction, admission closed the member's connection at once; now it takes the oldest idle
    one's slot, and its TLS handshake and first message go through."""
    server = data_identity(new_identity())
    admission = Admission(None)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await serve_data_port(admission, server, nursery)
            idle = []
            for n in range(1, admission.limits.max_per_prefix + 1):
                idle.append(await trio.open_tcp_stream("127.0.0.1", port))
                while admission.statistics()[0] < n:
                    await trio.sleep(0.01)
            tls = await connect(
                "127.0.0.1", port, pinned_client_context([server.certificate]),
                network_key=None, certificate=server.certificate,
            )  # fmt: skip
            async with tls:
                await tls.send_all(b"x")
                assert await tls.receive_some(2) == b"ok"
            assert await idle[0].receive_some(1) == b""  # the slot the member took
            for stream in idle:
                await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_a_data_port_closes_a_prefix_over_its_accept_rate_at_accept():
    admission = Admission(None, AdmissionLimits(accept_rate=0.001, accept_burst=2))
    handled = []

    async def handle(stream: trio.SocketStream) -> None:
        handled.append(stream)
        await trio.sleep_forever()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(admission.serve, handle, 0)
            port = listeners[0].socket.getsockname()[1]
            flood = [
                await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.5.1")
                for _ in range(5)
            ]
            for stream in flood[2:]:  # closed in the accept loop: no task was started
                assert await stream.receive_some(1) == b""
            other = await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.6.1")
            while len(handled) < 3:
                await trio.sleep(0.01)
            assert admission.budget.statistics().over_budget == 3
            for stream in [*flood, other]:
                await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_without_the_network_key_a_connection_never_gets_past_its_first_bytes():
    key = secrets.token_bytes(32)
    admission = Admission(key)
    for answer_with, accepted in ((key, True), (secrets.token_bytes(32), False), (None, False)):
        left, right = trio.testing.memory_stream_pair()
        outcome: list[BaseException | None] = []

        async def serve(left=left, outcome=outcome) -> None:
            try:
                await admission.check_network_key(left)
                outcome.append(None)
            except (ProtocolError, trio.BrokenResourceError) as error:
                outcome.append(error)

        async def dial(answer_with=answer_with, right=right) -> None:
            if answer_with is None:
                await right.aclose()  # hangs up instead of answering
            else:
                await prove_network_key(right, answer_with)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                nursery.start_soon(dial)
        assert (outcome[0] is None) == accepted, outcome


def test_a_peer_cannot_aim_a_member_at_its_own_machine():
    check_dial_address("192.0.2.1", 4000, own_host="198.51.100.1")
    check_dial_address("127.0.0.1", 4000, own_host="127.0.0.1")  # a one-machine collaboration
    for host, port in (("127.0.0.1", 22), ("0.0.0.0", 80), ("169.254.169.254", 80),
                       ("::1", 80), ("::ffff:127.0.0.1", 80), ("::ffff:169.254.169.254", 80),
                       ("224.0.0.1", 80), ("example.com", 80), ("192.0.2.1", 0), ("192.0.2.1", 70000)):  # fmt: skip
        with pytest.raises(ProtocolError):
            check_dial_address(host, port, own_host="198.51.100.1")
