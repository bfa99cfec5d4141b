"""TLS 1.3 for the data planes (all-reduce and state download), from the standard library.

libp2p's own Noise + yamux stream tops out near 0.3 GB/s, so bulk tensors travel on separate
TCP connections. Those are TLS 1.3 (stdlib `ssl`, OpenSSL) with certificates that carry the
libp2p identity the way the libp2p TLS spec does: a self-signed certificate over an ephemeral
P-256 key, with an extension holding the peer's libp2p public key and its signature over the
certificate's key (built and checked by py-libp2p's `libp2p.security.tls.certificate`). So a
certificate names exactly one peer id and nobody else can present it.

Python's `ssl` cannot accept "any certificate, checked by us" without ctypes hooks, so trust is
pinning: a peer's certificate reaches us first over an authenticated channel (a round's member
list, a donor's manifest, both over libp2p), `certificate_peer_id` checks it names the peer it
claims to be, `trust` adds it to our contexts' store, and after the handshake the caller checks
the other end presented exactly the certificate it expected (`TlsStream.peer_certificate`).

`TlsStream` drives a non-blocking `ssl.SSLSocket` with trio's readiness waits: OpenSSL reads
and writes the socket itself (`trio.SSLStream` ran at ~0.2 GB/s here, an `SSLObject` over memory
BIOs at ~1 GB/s with ~25 % more CPU per byte than this).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
import ssl
import tempfile
from collections import OrderedDict
from pathlib import Path

import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from libp2p.crypto.keys import PrivateKey
from libp2p.peer.id import ID
from libp2p.security.tls.certificate import (
    LIBP2P_CERT_PREFIX,
    add_libp2p_extension,
    verify_certificate_chain,
)

from peer.errors import ProtocolError

ALPN = "peertrain-data/2"  # 2: averages carry include masks (wire.py)
MAX_CERT_BYTES = 2048  # ours are ~600 bytes; a bigger one is not ours to parse
MAX_TRUSTED = 4096  # certificates in a context's store before it is rebuilt with the recent ones
KEEP_ON_REBUILD = 1024
_VERIFIED_CACHE = 4096
WRITE_BYTES = 1 << 18  # per TLS write: many 16 KiB records per Python call
RETRY_SECONDS = 0.01


def _build_certificate(identity_key: PrivateKey, *, seed: int | None = None) -> tuple[bytes, bytes]:
    """(certificate DER, private key PEM) for a fresh P-256 key bound to `identity_key`.
    `seed`: the same certificate for the same seed (the simulation's reproducible runs; a
    peer never passes one)."""
    if seed is None:
        tls_key = ec.generate_private_key(ec.SECP256R1())
        serial = x509.random_serial_number()
    else:
        order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # P-256's n
        tls_key = ec.derive_private_key(1 + seed % (order - 1), ec.SECP256R1())
        serial = 1 + seed % (2**159 - 1)
    spki = tls_key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    # OpenSSL finds a trusted certificate by its subject and tries only the first it loaded:
    # the subject names the key (`_subject`, checked by `certificate_peer_id`), so nobody can
    # shadow another's certificate, and a restarted peer's new one shadows nothing. The
    # validity spans any clock a volunteer's machine may show (the key dies with the process).
    name = _subject(spki)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(tls_key.public_key())
        .serial_number(serial)
        .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    signature = identity_key.sign(LIBP2P_CERT_PREFIX + spki)
    builder = add_libp2p_extension(builder, identity_key.get_public_key(), signature)
    certificate = builder.sign(tls_key, hashes.SHA256(), ecdsa_deterministic=seed is not None)
    key_pem = tls_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certificate.public_bytes(serialization.Encoding.DER), key_pem


def _subject(spki: bytes) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hashlib.sha256(spki).hexdigest())])


_verified: OrderedDict[bytes, str] = OrderedDict()


def certificate_peer_id(der: bytes) -> str:
    """The peer id a data-plane certificate belongs to; ProtocolError unless it is a
    well-formed, self-signed libp2p certificate whose extension that peer signed."""
    if len(der) > MAX_CERT_BYTES:
        raise ProtocolError(f"a certificate of {len(der)} bytes (the limit is {MAX_CERT_BYTES})")
    digest = hashlib.sha256(der).digest()
    known = _verified.get(digest)
    if known is not None:
        return known
    try:
        certificate = x509.load_der_x509_certificate(der)
        spki = certificate.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        if certificate.subject != _subject(spki) or certificate.issuer != _subject(spki):
            raise ValueError("its subject does not name its key")
        peer_id = ID.from_pubkey(verify_certificate_chain([certificate])).to_base58()
    except Exception as error:  # the libraries' errors on a peer's bytes: its fault, not ours
        raise ProtocolError(f"a certificate does not check out: {error!r}"[:200]) from None
    _verified[digest] = peer_id
    if len(_verified) > _VERIFIED_CACHE:
        _verified.popitem(last=False)
    return peer_id


class DataIdentity:
    """This process's data-plane certificate and the TLS contexts that present it.

    Three contexts: `server` (all-reduce: the client must present a trusted certificate),
    `open_server` (state donor: no client certificate; the ticket inside TLS authorises) and
    `client` (trusts the pinned certificates, presents ours when asked).
    """

    def __init__(self, identity_key: PrivateKey, peer_id: str) -> None:
        self.peer_id = peer_id
        self.certificate, self._key_pem = _build_certificate(identity_key)
        self._trusted: OrderedDict[bytes, None] = OrderedDict()
        self.open_server = self._context(server=True, client_certificate=False)
        self._rebuild([])

    def trust(self, certificates: list[bytes]) -> None:
        """Accept these (already checked) certificates in handshakes from now on."""
        new = [c for c in certificates if c not in self._trusted]
        for c in certificates:
            self._trusted[c] = None
            self._trusted.move_to_end(c)
        if len(self._trusted) > MAX_TRUSTED:  # the store only grows: start it again
            self._rebuild(list(self._trusted)[-KEEP_ON_REBUILD:])
        elif new:
            for context in (self.server, self.client):
                context.load_verify_locations(cadata=b"".join(new))

    def _rebuild(self, keep: list[bytes]) -> None:
        self._trusted = OrderedDict.fromkeys(keep)
        self.server = self._context(server=True, client_certificate=True)
        self.client = self._context(server=False, client_certificate=True)
        if keep:
            for context in (self.server, self.client):
                context.load_verify_locations(cadata=b"".join(keep))

    def _context(self, *, server: bool, client_certificate: bool) -> ssl.SSLContext:
        context = _base_context(server=server, verify=client_certificate or not server)
        # `load_cert_chain` reads files only: a private directory, removed at once.
        with tempfile.TemporaryDirectory(prefix="peertrain-tls-") as directory:
            cert_path, key_path = Path(directory, "cert.pem"), Path(directory, "key.pem")
            cert_path.write_bytes(ssl.DER_cert_to_PEM_cert(self.certificate).encode())
            descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as key_file:
                key_file.write(self._key_pem)
            context.load_cert_chain(cert_path, key_path)
        return context


def _base_context(*, server: bool, verify: bool) -> ssl.SSLContext:
    """TLS 1.3 only, our ALPN, no resumption; `verify`: the other end must present a trusted
    certificate (a server then asks the client for one)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # identity is the pinned certificate, not a name
    context.verify_mode = ssl.CERT_REQUIRED if verify else ssl.CERT_NONE
    context.set_alpn_protocols([ALPN])
    if server:
        context.num_tickets = 0  # no resumption: every connection proves its certificate
    return context


def pinned_client_context(certificates: list[bytes]) -> ssl.SSLContext:
    """A client context that trusts only `certificates` (already checked) and presents none:
    for a downloader, whom the donor knows by the ticket it sends inside TLS."""
    context = _base_context(server=False, verify=True)
    context.load_verify_locations(cadata=b"".join(certificates))
    return context


class TlsStream(trio.abc.Stream):
    """TLS over a trio TCP stream: a non-blocking `ssl.SSLSocket` on a duplicate of its socket,
    driven by trio's readiness waits. OpenSSL reads and writes the socket itself (two copies
    fewer per byte than memory BIOs, ~20 % less CPU here); trio runs one call at a time, so a
    task may send while another receives. `ssl.SSLError` becomes `ProtocolError`: whatever the
    other end sends is its fault. Close it (`aclose`) on every path: it owns a descriptor.
    """

    def __init__(
        self, stream: trio.SocketStream, context: ssl.SSLContext, *, server_side: bool
    ) -> None:
        self.stream = stream
        raw = stream.socket
        duplicate = socket.socket(raw.family, raw.type, raw.proto, fileno=os.dup(raw.fileno()))
        duplicate.setblocking(False)
        self._tls = context.wrap_socket(
            duplicate, server_side=server_side, do_handshake_on_connect=False
        )
        self._fd = self._tls.fileno()
        self._closed = False

    async def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await trio.lowlevel.wait_readable(self._fd)
            except ssl.SSLWantWriteError:
                await trio.lowlevel.wait_writable(self._fd)
            except ssl.SSLError as error:
                raise ProtocolError(f"TLS handshake failed: {error.reason or error}") from None
        if self._tls.selected_alpn_protocol() != ALPN:
            raise ProtocolError(f"the other end does not speak {ALPN}")

    def peer_certificate(self) -> bytes | None:
        return self._tls.getpeercert(binary_form=True)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            piece = view[:WRITE_BYTES]
            while True:
                try:
                    self._tls.send(piece)  # all of it, or WantWrite: retried with the same bytes
                    break
                except ssl.SSLWantWriteError:
                    await trio.lowlevel.wait_writable(self._fd)
                except ssl.SSLWantReadError:  # a renegotiation-like exchange: rare in TLS 1.3
                    await trio.sleep(RETRY_SECONDS)
                except ssl.SSLError as error:
                    raise ProtocolError(f"TLS: {error.reason or error}") from None
            view = view[len(piece) :]
        await trio.lowlevel.checkpoint()

    async def receive_into(self, view: memoryview) -> int:
        """Decrypted bytes into `view` (at least one); 0 at the end of the stream."""
        while True:
            try:
                return self._tls.recv_into(view)
            except ssl.SSLWantReadError:
                await trio.lowlevel.wait_readable(self._fd)
            except ssl.SSLWantWriteError:  # reading must send first (a KeyUpdate answer)
                await trio.sleep(RETRY_SECONDS)
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0  # the framing above tells a cut frame from a clean end
            except ssl.SSLError as error:
                raise ProtocolError(f"TLS: {error.reason or error}") from None

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Up to `max_bytes` decrypted bytes; b"" at the end of the stream."""
        buffer = bytearray(max_bytes or 65536)
        count = await self.receive_into(memoryview(buffer))
        return bytes(buffer[:count])

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.wait_writable(self._fd)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            trio.lowlevel.notify_closing(self._fd)  # wakes our own waiters on it
            self._tls.close()
        await self.stream.aclose()
