"""What a simulated peer's CPU spends on checking and hashing, charged in virtual time.

The simulator runs every peer's real code on one machine, so the CPU a check costs is spent
there and not on the virtual clock: a node checking thousands of signatures a second looked
free. Here each node has a core (`SimCpu`, a `SharedLink` of one CPU-second per second: what
runs on it at once shares it) and owes the costs below for the work its event loop does:

- an Ed25519 signature check (DHT entries, step signatures, attestations) the first time the
  node meets the signature (a real peer remembers what it checked): `VERIFY_SECONDS`; a
  progress read's step signatures are charged as the read meets them (`_records_checked`),
  since the checked records are remembered for every node at once;
- an Ed25519 signature made (records, tickets, step signatures): `SIGN_SECONDS`.

A check runs inside synchronous code (a decode, a record's validation) that cannot wait, so it
is owed (`charge`, to the node whose code runs: `CURRENT`, set per peer's tasks and, for a
request, while the callee's handler runs) and paid before the node's next message leaves
(`SimRpc`): its replies and requests wait for its CPU. Hashing a model's bytes happens in the
worker, off the event loop: the simulated worker waits `HASH_BYTES_PER_SECOND` for the
simulated model's bytes when it digests a step or checks a download (`SimWorker`).

The figures were measured on this machine class (2 cores, 2026-12): libp2p's Ed25519 (nacl)
verify 46 us and sign 19 us; BLAKE2b (the parameters' digest) 0.87 GB/s, BLAKE3 (the chunks of
a state download) 4.9 GB/s. Only a first check costs: each node keeps its own memory of them
here, since the process's caches are shared by every node of the simulation.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from libp2p.crypto.ed25519 import Ed25519PrivateKey

from peer.dht import node as dht_node
from peer.dht import records
from peer.measure import attestation
from peer.training import certificate, progress, publisher
from simulation.links import SharedLink, carry

VERIFY_SECONDS = 46e-6
SIGN_SECONDS = 19e-6
CHECKED_CACHE = 8192
"""Signatures a node remembers having checked (`peer.dht.records.VERIFIED_CACHE`)."""
HASH_BYTES_PER_SECOND = 0.87e9
"""BLAKE2b over the parameters: a step's digest, and a download's check (with BLAKE3's
chunk hashes, 5.6x faster, on top: `download_check_seconds`)."""
CHUNK_HASH_BYTES_PER_SECOND = 4.9e9


class SimCpu:
    """One node's core for its event loop's work."""

    def __init__(self) -> None:
        self.core = SharedLink(1.0)
        self.owed = 0.0
        self.spent = 0.0
        """CPU-seconds charged in all."""
        self._checked: OrderedDict[bytes, None] = OrderedDict()

    def charge(self, seconds: float) -> None:
        self.owed += seconds
        self.spent += seconds

    def first_check(self, signature: bytes) -> bool:
        """Whether this node checks `signature` for the first time (as far as a cache of a
        real peer's size remembers): the process's caches are shared by every simulated
        node, so each node's own is kept here (by the signature itself: a bytes object
        keeps its hash, and every reader of a record meets the same ones)."""
        return self.first_checks((signature,)) == 1

    def first_checks(self, signatures: tuple[bytes, ...]) -> int:
        """How many of `signatures` this node checks for the first time, met in their order
        (`first_check` of each, in one loop: a read at 1,000 simulated peers meets a thousand
        records' step signatures, a call for each)."""
        checked, touch, first = self._checked, self._checked.move_to_end, 0
        for signature in signatures:
            if signature in checked:
                touch(signature)
                continue
            checked[signature] = None
            first += 1
            if len(checked) > CHECKED_CACHE:
                checked.popitem(last=False)
        return first

    async def pay(self) -> None:
        """Wait while the core does what was charged since the last payment."""
        if self.owed > 0:
            owed, self.owed = self.owed, 0.0
            await carry(owed, self.core)


CURRENT: contextvars.ContextVar[SimCpu | None] = contextvars.ContextVar("sim_cpu", default=None)


def charge(seconds: float) -> None:
    cpu = CURRENT.get()
    if cpu is not None:
        cpu.charge(seconds)


def download_check_seconds(state_bytes: float) -> float:
    """A downloaded state's check: every chunk's BLAKE3, then the parameters' digest."""
    return state_bytes / CHUNK_HASH_BYTES_PER_SECOND + state_bytes / HASH_BYTES_PER_SECOND


def _check(signature: bytes) -> None:
    cpu = CURRENT.get()
    if cpu is not None and cpu.first_check(signature):
        cpu.charge(VERIFY_SECONDS)


def _records_checked(entries: dict[str, Any]) -> None:
    """Charge a progress read's step signatures as `decode_progress` met them before its
    memo of checked records: every signature of every record it keeps, in the entries'
    order (the process's memo is every node's; each node pays its own first checks)."""
    cpu = CURRENT.get()
    if cpu is None:
        return
    first_checks = cpu.first_checks
    for subkey, entry in entries.items():
        signatures = _step_signatures(subkey, entry.value)
        if signatures:
            for _ in range(first_checks(signatures)):  # one by one: the same sums as ever
                cpu.charge(VERIFY_SECONDS)


@functools.lru_cache(maxsize=progress.DECODED_RECORDS)
def _step_signatures(subkey: str, value: bytes | None) -> tuple[bytes, ...]:
    """The step signatures `decode_progress` meets in the entry `subkey: value` (none where it
    keeps no record of it), remembered: a read meets a record's every signature, a
    thousand records a read at 1,000 simulated peers, and it took each through the
    record's decode memo and its signatures' attributes (6 % of such a run's CPU)."""
    if records.owner_key(subkey) is None:
        return ()
    small = value is not None and len(value) <= progress.DECODED_RECORD_BYTES
    record = progress._decoded(value) if small else progress._decode(value)
    if record is None or record.peer_id != subkey:
        return ()
    return tuple(signature.signature for signature in record.signatures)


@contextlib.contextmanager
def charged() -> Iterator[None]:
    """While this lasts, every signature a node checks for the first time, or makes, is
    charged to it (the functions are swapped where their callers look them up)."""
    validate_entry, valid, signed, sign, decode_progress = (
        records.validate_entry,
        certificate._valid,
        attestation.signed,
        Ed25519PrivateKey.sign,
        progress.decode_progress,
    )

    def validate_entry_charged(key: str, subkey: str, entry: records.Entry, **kw: Any) -> None:
        if entry.signature:
            _check(entry.signature)
        validate_entry(key, subkey, entry, **kw)

    def valid_charged(signature: certificate.StepSignature, *args: Any) -> bool:
        _check(signature.signature)
        return valid(signature, *args)

    def signed_charged(a: attestation.Attestation) -> bool:
        _check(a.signature)
        return signed(a)

    def sign_charged(key: Ed25519PrivateKey, data: bytes) -> bytes:
        charge(SIGN_SECONDS)
        return sign(key, data)

    def decode_progress_charged(
        entries: dict[str, Any], *, collaboration: str
    ) -> list[progress.ProgressRecord]:
        uncharged = CURRENT.set(None)  # its memo's misses check for every node at once
        try:
            decoded = decode_progress(entries, collaboration=collaboration)
        finally:
            CURRENT.reset(uncharged)
        _records_checked(entries)
        return decoded

    swaps: list[tuple[Any, str, Any, Any]] = [
        (records, "validate_entry", validate_entry, validate_entry_charged),
        (dht_node, "validate_entry", validate_entry, validate_entry_charged),
        (certificate, "_valid", valid, valid_charged),
        (attestation, "signed", signed, signed_charged),
        (Ed25519PrivateKey, "sign", sign, sign_charged),
        (progress, "decode_progress", decode_progress, decode_progress_charged),
        (publisher, "decode_progress", decode_progress, decode_progress_charged),
    ]
    for owner, name, _, charged_one in swaps:
        setattr(owner, name, charged_one)
    try:
        yield
    finally:
        for owner, name, real, _ in swaps:
            setattr(owner, name, real)
