"""Messages of the DHT protocol `/peertrain/dht/1` (msgspec schemas, validated on receipt).

    find_node(FindNode) -> Nodes       the contacts the callee knows closest to `target`
    store(Store)        -> StoreReply   keep these entries of `key`; one verdict per subkey
    get(Get)            -> GetReply     the entries of `key` it holds that fit one reply
                                        (`records.select`), plus closer contacts; with
                                        `pages` > 1 only those of page `page`
                                        (`records.page_of`), and `pages` in the reply says
                                        how many pages its entries would fill

A server-mode caller sends its own dialable addresses in `caller_addrs` so the callee can add
it to its routing table; its peer id comes from the authenticated connection, never from the
message. A client-mode caller (e.g. `peer status`) sends none and is never added. The same
authenticated peer id is the writer of what it stores: only its own peer id among the
owner-signed subkeys, so a store carries at most `MAX_STORE_ENTRIES` entries.
"""

from __future__ import annotations

import functools
from typing import Annotated

import msgspec
from libp2p.peer.id import ID

from peer.dht.records import MAX_KEY_BYTES, MAX_OPEN_SUBKEYS, MAX_SUBKEY_BYTES, Entry
from peer.dht.routing import Contact

SERVICE = "dht"
MAX_ADDRS = 16
MAX_CONTACTS = 64
MAX_ENTRIES = 4096  # in a get reply: more than a reader takes, which it trims (records.select)
#: Pages a key's entries may be read in (`Get.pages`): 8 replies of `node.REPLY_BYTES` hold
#: ~2,000 progress records, every reply still within a stream's send window.
MAX_PAGES = 8
#: Entries one store may carry: all a writer may hold of a key (its own id and its open subkeys).
MAX_STORE_ENTRIES = 1 + MAX_OPEN_SUBKEYS

Addr = Annotated[str, msgspec.Meta(max_length=256)]
Addrs = Annotated[list[Addr], msgspec.Meta(max_length=MAX_ADDRS)]
Key = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Subkey = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SUBKEY_BYTES)]
Entries = Annotated[dict[Subkey, Entry], msgspec.Meta(max_length=MAX_ENTRIES)]
StoreEntries = Annotated[dict[Subkey, Entry], msgspec.Meta(max_length=MAX_STORE_ENTRIES)]


class WireContact(msgspec.Struct, frozen=True):
    peer_id: Annotated[str, msgspec.Meta(max_length=128)]
    addrs: Addrs

    @classmethod
    def of(cls, contact: Contact) -> WireContact:
        return _wire_contact(contact.peer_id, contact.addrs)


@functools.lru_cache(maxsize=2048)
def _wire_contact(peer_id: ID, addrs: tuple[str, ...]) -> WireContact:
    """Cached: every find_node reply names 20 contacts, the same ones over and over (3 % of
    a 300-peer simulation's CPU went to building them)."""
    return WireContact(peer_id.to_base58(), list(addrs))


class FindNode(msgspec.Struct, frozen=True):
    target: Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
    caller_addrs: Addrs | None = None


class Nodes(msgspec.Struct, frozen=True):
    nodes: Annotated[list[WireContact], msgspec.Meta(max_length=MAX_CONTACTS)]


class Store(msgspec.Struct, frozen=True):
    key: Key
    entries: StoreEntries
    caller_addrs: Addrs | None = None


class StoreReply(msgspec.Struct, frozen=True):
    # subkey -> "stored" | "kept-newer" | "rejected: <reason>"
    verdicts: dict[str, str]


class Get(msgspec.Struct, frozen=True):
    key: Key
    caller_addrs: Addrs | None = None
    page: Annotated[int, msgspec.Meta(ge=0, lt=MAX_PAGES)] = 0
    pages: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGES)] = 1
    """Read the entries whose subkeys fall in page `page` of `pages` (`records.page_of`)."""
    contacts: bool = True
    """Whether the reply names the nodes nearest the key (a lookup's next hops); a hot read
    asks holders it knows and needs none (20 contacts: ~2 KB of each reply)."""


class GetReply(msgspec.Struct, frozen=True):
    entries: Entries
    nodes: Annotated[list[WireContact], msgspec.Meta(max_length=MAX_CONTACTS)]
    pages: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGES)] = 1
    """Pages the replica's entries of the key (of the page asked for) would fill, at most
    MAX_PAGES: more than the asked-for `pages` when it left entries out of this reply."""


def to_contacts(wire: list[WireContact], *, exclude: ID) -> list[Contact]:
    """Contacts from a reply, skipping ids that do not parse and ourselves."""
    out = []
    for item in wire:
        contact = _contact(item.peer_id, tuple(item.addrs))
        if contact is not None and contact.peer_id != exclude:
            out.append(contact)
    return out


@functools.lru_cache(maxsize=4096)
def _contact(peer_id: str, addrs: tuple[str, ...]) -> Contact | None:
    """A reply's contact, None where its id does not parse or it names no address. Cached
    (a `Contact` is frozen): a find_node reply names 20 of them, the same ones over and over,
    and building each again was 6 % of the first 30 virtual seconds of 1,000 simulated peers."""
    parsed = _peer_id(peer_id)
    return Contact(parsed, addrs) if parsed is not None and addrs else None


@functools.lru_cache(maxsize=4096)
def _peer_id(text: str) -> ID | None:
    """A contact's id, or None if it does not parse. Cached: replies name the same nodes over
    and over, and base58 decoding was most of a lookup's CPU."""
    try:
        return ID.from_base58(text)
    except Exception:  # base58/multihash errors: a bad contact is ignored, not fatal
        return None
