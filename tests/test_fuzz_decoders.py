"""Fuzzing of every decoder that reads bytes from the network (issue 7, in part).

Each decoder gets arbitrary bytes, msgpack documents shaped like its messages (the field names
and tags of its schema as keys, any values), and mutations (bit flips, truncations, insertions)
of a valid encoding. It must return or raise one of the errors its callers handle as "the peer
sent garbage"; anything else would escape as a crash of the task serving that peer.

The default run tries a few hundred inputs per decoder; `-m slow` runs 100,000 each, and checks
that a long seeded stream of the same kinds of input leaves neither traced Python memory nor the
process's resident memory growing (a decoder that keeps something from every message would).
"""

from __future__ import annotations

import contextlib
import gc
import random
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.averaging.compression import CODECS, BadPart
from peer.averaging.group import Ticket
from peer.averaging.matchmaking import Begin, JoinReply, Redirect, TooFew
from peer.averaging.wire import Hello
from peer.dht import protocol as dht
from peer.dht.records import Entry, Limits, make_entry, validate_entry
from peer.errors import DECODE_ERRORS, ProtocolError
from peer.measure import probe
from peer.measure.capabilities import Capabilities
from peer.measure.reachability import DialBack, DialBackResult
from peer.net import rpc
from peer.net.framing import FrameDecoder, encode_frame
from peer.presence import PresenceRecord, decode_presence
from peer.training import chunks
from peer.training import state as states
from peer.training.progress import ProgressRecord, decode_progress, encode_progress
from tests.test_progress import PEERS, rec

ALLOWED = (ProtocolError, *DECODE_ERRORS)
KEY_PAIR = create_new_key_pair()
OWNER = ID.from_pubkey(KEY_PAIR.public_key).to_base58()
LIMITS = Limits(
    max_value_bytes=65536, max_subkeys=4096, max_keys=100000, max_ttl=86400.0, max_clock_skew=10.0
)
NOW = 1_800_000_000.0


@dataclass(frozen=True)
class Case:
    name: str
    decode: Callable[[bytes], object]
    valid: bytes
    """A valid encoding, mutated by the fuzzer."""
    names: tuple[str, ...] = ()
    """Field names and tags its messages use (keys of the shaped documents)."""
    allowed: tuple[type[BaseException], ...] = ALLOWED


def names_of(*types: type) -> tuple[str, ...]:
    out = ["type"]
    for t in types:
        out += [f.encode_name for f in msgspec.structs.fields(t)]
        out.append(t.__name__)
    return tuple(out)


def frames(data: bytes) -> object:
    decoder = FrameDecoder(4096)
    decoder.feed(data)
    out = []
    while (frame := decoder.next_frame()) is not None:
        out.append(frame)
    return out


def rpc_request(data: bytes) -> object:
    request = rpc._request_decoder.decode(data)
    return msgspec.msgpack.decode(request.body, type=dht.Store)


def dht_store(data: bytes) -> object:
    """A Store request as a DHT node receives it: decoded, then every entry validated."""
    store = msgspec.msgpack.decode(data, type=dht.Store)
    for subkey, entry in store.entries.items():
        try:
            validate_entry(store.key, subkey, entry, now=NOW, limits=LIMITS)
        except ProtocolError:
            continue  # refused: what a node answers "rejected: ..."
    return store


def progress(data: bytes) -> object:
    return decode_progress({PEERS[0]: Entry(value=data, expiration=NOW + 10)}, collaboration="c")


def presence(data: bytes) -> object:
    return decode_presence({OWNER: Entry(value=data, expiration=NOW + 10)})


def manifest(data: bytes) -> object:
    """A donor's manifest as a downloader checks it: schema, then check_manifest."""
    offer = msgspec.msgpack.decode(data, type=chunks.Manifest)
    chunks.check_manifest(offer, min_step=0, max_total_bytes=1 << 30)
    return offer


def codec(name: str) -> Callable[[bytes], object]:
    return lambda data: CODECS[name].decode(data, 8)


def state_blob() -> bytes:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return states.to_bytes(states.capture(3, model, {"main": optimizer}))


SIGNED = make_entry("c/presence", OWNER, b"x", NOW + 5, signer=KEY_PAIR.private_key)
CASES = [
    Case("frames", frames, encode_frame(b"hello") + encode_frame(b"")),
    Case(
        "rpc request",
        rpc_request,
        rpc._encoder.encode(rpc.Request("store", rpc._raw(dht.Store("k", {})))),
        names_of(rpc.Request, rpc.Ok, rpc.Item, rpc.End, rpc.Err, dht.Store),
    ),
    Case(
        "dht store",
        dht_store,
        msgspec.msgpack.encode(dht.Store("c/presence", {OWNER: SIGNED})),
        names_of(dht.Store, Entry),
    ),
    Case(
        "dht get reply",
        lambda data: msgspec.msgpack.decode(data, type=dht.GetReply),
        msgspec.msgpack.encode(dht.GetReply({OWNER: SIGNED}, [])),
        names_of(dht.GetReply, dht.WireContact, Entry),
    ),
    Case(
        "progress record",
        progress,
        encode_progress(rec(0, loss=1.5, recent_losses=[2.0])),
        names_of(ProgressRecord),
    ),
    Case(
        "presence record",
        presence,
        msgspec.msgpack.encode(PresenceRecord(OWNER, "peer", [], "0.1.0", NOW, NOW)),
        names_of(PresenceRecord, Capabilities),
    ),
    Case(
        "ticket",
        lambda data: msgspec.msgpack.decode(data, type=Ticket),
        msgspec.msgpack.encode(Ticket(OWNER, [], "127.0.0.1", 4002, True, 8.0)),
        names_of(Ticket, Capabilities),
    ),
    Case(
        "all-reduce hello",
        lambda data: msgspec.msgpack.decode(data, type=Hello),
        msgspec.msgpack.encode(Hello(bytes(16), OWNER)),
        names_of(Hello),
    ),
    Case(
        "probe request",
        probe._requests.decode,
        msgspec.msgpack.encode(probe.Ping()),
        names_of(probe.Ping, probe.Probe),
    ),
    Case(
        "probe reply",
        probe._replies.decode,
        msgspec.msgpack.encode(probe.Pong(NOW)),
        names_of(probe.Pong, probe.Accepted, probe.Refused, probe.Measured),
    ),
    Case(
        "dial-back",
        lambda data: msgspec.msgpack.decode(data, type=DialBack),
        msgspec.msgpack.encode(DialBack(["/ip4/127.0.0.1/tcp/1"])),
        names_of(DialBack, DialBackResult),
    ),
    Case(
        "state manifest",
        manifest,
        msgspec.msgpack.encode(
            chunks.Manifest(
                3,
                10,
                [10],
                [bytes(32)],
                "127.0.0.1",
                4003,
                bytes(32),
                bytes(600),
            )
        ),
        names_of(chunks.Manifest, chunks.ManifestRequest, chunks.Release),
    ),
    Case(
        "join reply",
        lambda data: msgspec.msgpack.decode(data, type=JoinReply),
        msgspec.msgpack.encode(TooFew(1, 2)),
        names_of(Begin, Redirect, TooFew),
    ),
    Case("codec none", codec("none"), bytes(32), allowed=(BadPart,)),
    Case("codec fp16", codec("fp16"), bytes(16), allowed=(BadPart,)),
    Case("codec int8", codec("int8"), bytes(CODECS["int8"].wire_bytes(8)), allowed=(BadPart,)),
    Case("state blob", states.from_bytes, state_blob(), allowed=(ProtocolError,)),
]
# decode_progress and decode_presence skip what they cannot use: they must never raise.
NEVER_RAISE = {"progress record", "presence record"}


def mutate(valid: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """`valid` with each (kind, position, value) edit: a bit flip, a truncation or an insertion."""
    data = bytearray(valid)
    for kind, position, value in edits:
        at = position % (len(data) + 1)
        if kind == 0 and data:
            data[at % len(data)] ^= 1 << (value % 8)
        elif kind == 1:
            del data[at:]
        else:
            data[at:at] = bytes([value % 256])
    return bytes(data)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=64),
)


def inputs(case: Case) -> st.SearchStrategy[bytes]:
    keys = st.sampled_from(case.names) | st.text(max_size=12) if case.names else st.text()
    # Three levels of nesting, built out explicitly: deep enough for every schema here (a
    # struct holding a map of structs holding lists).
    documents = scalars | st.sampled_from(case.names or ("",))
    for _ in range(3):
        documents = (
            documents
            | st.lists(documents, max_size=5)
            | st.dictionaries(keys, documents, max_size=5)
        )

    edits = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2**16), st.integers(0, 255)))
    return st.one_of(
        st.binary(max_size=512),
        documents.map(msgspec.msgpack.encode),
        edits.map(lambda edits: mutate(case.valid, edits)),
    )


def fuzz(case: Case, examples: int) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(inputs(case))
    def check(data: bytes) -> None:
        if case.name in NEVER_RAISE:
            case.decode(data)
            return
        with contextlib.suppress(*case.allowed):
            case.decode(data)

    check()


def test_every_valid_sample_decodes():
    for case in CASES:
        case.decode(case.valid)  # the mutations start from something the decoder accepts


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_garbage_never_escapes_as_another_error(case):
    fuzz(case, 300)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_hundred_thousand_inputs_per_decoder(case):
    fuzz(case, 100_000)


# The leak check: a seeded stream of the same three kinds of input as `inputs`, generated without
# hypothesis so that nothing but the decoder allocates between two measurements.
WARM_UP = 2_000
BATCHES = 5
BATCH = 4_000
MAX_TRACED_GROWTH = 256 * 1024
"""Bytes of traced Python memory the last measured batch may hold beyond the first."""
MAX_RSS_GROWTH = 32 * 1024 * 1024
"""Resident memory the measured batches may add (native allocations tracemalloc cannot see:
msgspec, numpy, torch, cryptography); generous, as the allocator keeps what it freed."""


def random_scalar(rng: random.Random) -> object:
    match rng.randrange(6):
        case 0:
            return None
        case 1:
            return rng.random() < 0.5
        case 2:
            return rng.randrange(-(2**63), 2**64)
        case 3:
            return rng.choice((float("nan"), float("inf"), -float("inf"), rng.uniform(-1e9, 1e9)))
        case 4:
            return "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(41)))
        case _:
            return rng.randbytes(rng.randrange(65))


def random_document(rng: random.Random, case: Case, depth: int = 3) -> object:
    """A msgpack document up to three levels deep, keyed by the case's field names and tags."""
    roll = rng.randrange(4) if depth else 0
    if roll == 0:
        return random_scalar(rng)
    if roll == 1:
        return rng.choice(case.names or ("",))
    if roll == 2:
        return [random_document(rng, case, depth - 1) for _ in range(rng.randrange(6))]
    return {
        (
            rng.choice(case.names) if case.names and rng.random() < 0.7 else str(random_scalar(rng))
        ): random_document(rng, case, depth - 1)
        for _ in range(rng.randrange(6))
    }


def seeded_inputs(case: Case, rng: random.Random, count: int) -> Iterator[bytes]:
    for _ in range(count):
        match rng.randrange(3):
            case 0:
                yield rng.randbytes(rng.randrange(513))
            case 1:
                yield msgspec.msgpack.encode(random_document(rng, case))
            case _:
                edits = [
                    (rng.randrange(3), rng.randrange(2**16), rng.randrange(256))
                    for _ in range(rng.randrange(1, 9))
                ]
                yield mutate(case.valid, edits)


def feed(case: Case, rng: random.Random, count: int) -> None:
    for data in seeded_inputs(case, rng, count):
        if case.name in NEVER_RAISE:
            case.decode(data)
            continue
        with contextlib.suppress(*case.allowed):
            case.decode(data)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_no_decoder_leaks_memory(case):
    rng = random.Random(f"leak {case.name}")
    process = psutil.Process()
    tracemalloc.start()
    try:
        feed(case, rng, WARM_UP)  # caches, interned names, lazily built decoders
        traced, rss = [], []
        for _ in range(BATCHES):
            feed(case, rng, BATCH)
            gc.collect()
            traced.append(tracemalloc.get_traced_memory()[0])
            rss.append(process.memory_info().rss)
    finally:
        tracemalloc.stop()
    figures = (
        f"{case.name}: traced {traced[0]} -> {traced[-1]} B ({traced[-1] - traced[0]:+d}),"
        f" rss {rss[0] / 2**20:.1f} -> {rss[-1] / 2**20:.1f} MiB"
        f" ({(rss[-1] - rss[0]) / 2**20:+.1f}); traced per batch {traced}"
    )
    print(figures)
    assert traced[-1] - traced[0] <= MAX_TRACED_GROWTH, figures
    assert rss[-1] - rss[0] <= MAX_RSS_GROWTH, figures
