"""Kademlia routing, pure: node ids, XOR distance, k-buckets and the iterative lookup.

Node ids and key ids are SHA-256 digests read as 256-bit integers; the distance between two
ids is their XOR (Maymounkov & Mazieres, "Kademlia", 2002). `RoutingTable` keeps up to k
contacts per bucket, least recently seen first, plus a small replacement cache that refills a
bucket when a contact fails. `Lookup` is the iterative search as a state machine: the caller
asks which nodes to query next, reports each answer or failure, and stops when `done`.
`Unresponsive` remembers the contacts whose calls failed us, so that lookups do not ask them
again while other nodes still name them.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from libp2p.peer.id import ID

ID_BITS = 256


_SPREAD = re.compile(r"(.+)#spread/([1-9]|1[0-6])/(0|[1-9][0-9]{0,4})")
MAX_SPREAD_BITS = 16


@functools.lru_cache(maxsize=4096)
def key_id(key: str) -> int:
    """A key's place on the ring: its SHA-256, or for a key of a spread family
    (`spread_key`) its index as the top bits and its family's hash below. Remembered: a hot
    read works it out for each shard key several times, and each replica for each request (a
    regular expression and a hash each time: 4.4 % of the samples of a 300-peer simulation's
    progress reads, py-spy)."""
    spread = _spread(key)
    if spread is None:
        return _sha256(key)
    family, bits, index = spread
    return (index << (ID_BITS - bits)) | (_sha256(f"{family}#spread/{bits}") >> bits)


def spread_bits(key: str) -> int:
    """The prefix a spread key's id shares with no other key of its family (0: a hashed key)."""
    spread = _spread(key)
    return 0 if spread is None else spread[1]


@functools.lru_cache(maxsize=4096)
def _spread(key: str) -> tuple[str, int, int] | None:
    """(family, bits, index) of a well-formed spread key (`spread_key`), else None
    (remembered, as `key_id`)."""
    match = _SPREAD.fullmatch(key)
    if match is None or int(match[3]) >= 1 << int(match[2]):
        return None
    return match[1], int(match[2]), int(match[3])


def in_prefix(node: int, target: int, bits: int) -> bool:
    """Whether id `node` shares `target`'s top `bits` bits (never, for 0: a hashed key)."""
    return bits > 0 and (node ^ target) >> (ID_BITS - bits) == 0


def hot_holders(target: int, bits: int, closest: list[Contact], replicas: int) -> int:
    """How many of `closest` (the nearest to `target` first, as many as a lookup found) hold a
    hot key: every one whose id shares the key's `bits`-bit prefix (`spread_bits`), and at
    least the `replicas` closest. A spread family's keys then split the nodes between them,
    each node a holder of one: with the `replicas` closest alone, 8 progress shards at 100
    simulated peers left a third of the nodes serving nothing, and the busiest sent 2.1x the
    mean node's replies."""
    return max(replicas, sum(in_prefix(c.id, target, bits) for c in closest))


#: Holders of a spread key's prefix a hot read needs before it asks them alone (else it asks
#: any of the holders, most of them outside the prefix): two identities ground into a prefix
#: with no honest node would otherwise be every reader's only source of that shard (found in
#: review). With 4, by placement, the busiest node serves at most 1.4x the mean (1.0x with 2).
MIN_PREFIX_READ = 4


def hot_read_order(
    target: int, bits: int, holders: list[Contact], shuffle: Callable[[list[Contact]], None]
) -> list[Contact]:
    """The order a hot read asks `holders` in: those of the key's prefix first, shuffled, when
    they are at least `MIN_PREFIX_READ` (their records are about as many as they are:
    `peer.training.shards`; the others hold the key only because the prefix has fewer than
    `replicas` nodes, and hold their own prefix's key too); else all of them, shuffled."""
    first = first_readers(target, bits, holders)
    rest = [c for c in holders if c not in first]
    for part in (first, rest) if rest else (first,):
        shuffle(part)
    return first + rest


def first_readers(target: int, bits: int, holders: list[Contact]) -> list[Contact]:
    """The holders a hot read asks first (`hot_read_order`): those of the key's prefix where
    they are at least `MIN_PREFIX_READ`, else every one."""
    inside = [c for c in holders if in_prefix(c.id, target, bits)]
    return inside if len(inside) >= MIN_PREFIX_READ else list(holders)


def _sha256(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest(), "big")


def spread_key(family: str, bits: int, index: int) -> str:
    """Key `index` of a family of 2^bits keys that split the ring between them: key `index`'s
    id has `index` as its top `bits` bits (the family's hash below), so the nodes whose ids
    start so hold it (`hot_holders`), and no two keys of the family share a holder while such a
    prefix holds `replicas` nodes. Hashed keys share replicas by chance: 8 keys of 8 replicas
    each, among 100 nodes, landed on ~64 of them, and a reader of all of them made the
    replicas of the largest the busiest (5.8x the mean node's replies, simulated)."""
    if not 1 <= bits <= MAX_SPREAD_BITS or not 0 <= index < 1 << bits:
        raise ValueError(
            f"spread key {index} of 2^{bits}: expected 1 <= bits <= 16, index < 2^bits"
        )
    return f"{family}#spread/{bits}/{index}"


@functools.lru_cache(maxsize=8192)
def node_id(peer_id: ID) -> int:
    return int.from_bytes(hashlib.sha256(peer_id.to_bytes()).digest(), "big")


@dataclass(frozen=True)
class Contact:
    """A DHT server node: who it is and where to dial it."""

    peer_id: ID
    addrs: tuple[str, ...]
    id: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", node_id(self.peer_id))


class RoutingTable:
    def __init__(self, own_id: ID, *, bucket_size: int, replacements: int = 8) -> None:
        self.own = node_id(own_id)
        self.own_peer = own_id
        self.bucket_size = bucket_size
        self.replacements = replacements
        self._buckets: list[OrderedDict[ID, Contact]] = [OrderedDict() for _ in range(ID_BITS)]
        self._spare: list[OrderedDict[ID, Contact]] = [OrderedDict() for _ in range(ID_BITS)]
        self._everyone: dict[int, Contact] = {}
        """Every bucket's contacts by node id: what `nearest` scans (a lookup's every step and
        every find_node we answer; the buckets' 256 dicts and a key function per contact were
        7 % of a 100-peer simulation's CPU)."""

    def _bucket_index(self, other: int) -> int:
        return max((self.own ^ other).bit_length() - 1, 0)

    def __len__(self) -> int:
        return len(self._everyone)

    def __contains__(self, peer_id: ID) -> bool:
        return peer_id in self._buckets[self._bucket_index(node_id(peer_id))]

    def get(self, peer_id: ID) -> Contact | None:
        return self._buckets[self._bucket_index(node_id(peer_id))].get(peer_id)

    def add(self, contact: Contact) -> None:
        """Record that `contact` answered: it moves to the tail (most recently seen).

        A full bucket keeps its old contacts (long-lived nodes tend to stay, per the paper) and
        the newcomer waits in the replacement cache.
        """
        if contact.peer_id == self.own_peer:
            return
        index = self._bucket_index(contact.id)
        bucket = self._buckets[index]
        if contact.peer_id in bucket or len(bucket) < self.bucket_size:
            bucket[contact.peer_id] = contact
            bucket.move_to_end(contact.peer_id)
            self._everyone[contact.id] = contact
            return
        spare = self._spare[index]
        spare[contact.peer_id] = contact
        spare.move_to_end(contact.peer_id)
        while len(spare) > self.replacements:
            spare.popitem(last=False)

    def remove(self, peer_id: ID) -> None:
        """Forget a contact that failed; the freshest replacement takes its place."""
        index = self._bucket_index(node_id(peer_id))
        self._spare[index].pop(peer_id, None)
        if self._buckets[index].pop(peer_id, None) is None:
            return
        del self._everyone[node_id(peer_id)]
        if self._spare[index]:
            _, replacement = self._spare[index].popitem(last=True)
            self._buckets[index][replacement.peer_id] = replacement
            self._everyone[replacement.id] = replacement

    def nearest(self, target: int, count: int, *, exclude: Iterable[ID] = ()) -> list[Contact]:
        everyone = self._everyone
        excluded = {node_id(peer_id) for peer_id in exclude}
        ids = heapq.nsmallest(count + len(excluded), everyone, key=target.__xor__)
        return [everyone[i] for i in ids if i not in excluded][:count]

    def contacts(self) -> list[Contact]:
        return [c for bucket in self._buckets for c in bucket.values()]


#: Answers from a spread key's prefix that end a read's lookup of its holders (`Lookup`).
READ_ANSWERS = 3
#: Answers that must name a node of the prefix a read has not heard from itself for it to
#: count toward `MIN_PREFIX_READ` (`Lookup.read_enough`).
NAMED_BY = 2


class Lookup:
    """Iterative Kademlia lookup toward `target`, as a state machine without I/O.

    Keeps the `k` closest contacts seen so far. Up to `alpha` queries are in flight; the lookup
    is done when every one of the k closest live contacts has answered and nothing is pending.
    A query the caller reports as stalled (`on_stall`) is no longer waited for.

    A spread key's lookup (`prefix_bits`: its `spread_bits`) looks for the nodes of its prefix,
    however many (`hot_holders`), and at least `least`: its depth is those of the prefix it
    knows of, plus the nearest node beyond the prefix, at least `least` and at most `k`. The
    nodes nearest a target are those of its prefix, and each of them names the others in its
    answer, so the depth grows as they are found; asked to depth `k` (24) always, a reader of 64
    shards made ~30 find_node calls a shard where the prefix held ~8 nodes.

    A read of a spread key (`read`: a number of answers) needs a few of its holders, not each
    of them confirmed: each node of a prefix knows the others, so its lookup may end once the
    first `read` nodes of the prefix in an order of its own have answered (`read_enough`;
    those that fail or stall drop out of the order). The order is a hash of each node's id
    keyed with `salt`: asked nearest the key first, nodes that ground their ids next to it would
    be every reader's first answers, and asked nearest a salted point, a node alone in a wide
    part of the prefix would be asked first most often. It ends early only where the prefix
    shows at least `MIN_PREFIX_READ` nodes (those that answered, or that
    `NAMED_BY` of the prefix's answers named at the same addresses) and each answer from the
    prefix named a node beyond it too (so it named every node of the prefix it knows: an
    answer holds `dht.bucket_size` nodes, and those of a larger prefix are not all in it); else
    it goes to the end, as a store's does. Its holders (`read_holders`) are then those first
    `read` nodes of the prefix, and nothing beyond it.
    """

    def __init__(
        self,
        target: int,
        seeds: Iterable[Contact],
        *,
        k: int,
        alpha: int,
        prefix_bits: int = 0,
        least: int = 0,
        read: int = 0,
        salt: bytes = b"",
    ) -> None:
        if read and not (prefix_bits and salt):
            raise ValueError("a read lookup is of a spread key, and salted")
        self.target = target
        self.k = k
        self.alpha = alpha
        self.prefix_bits = prefix_bits
        self.least = least
        self.read = read
        self._salt = salt
        self._order: dict[ID, bytes] = {}
        """Each node of the prefix's place in a read's order (`_rank`), computed once."""
        self._cut_answers = 0
        """Answers from the prefix that named nobody beyond it (a read then goes to the end)."""
        self._known: dict[ID, Contact] = {}
        self._answered: set[ID] = set()
        self._failed: set[ID] = set()
        self._pending: set[ID] = set()
        self._stalled: set[ID] = set()
        self._named: dict[ID, dict[tuple[str, ...], set[ID]]] = {}
        """A read's evidence: for each node of the prefix, at each addresses, the nodes of the
        prefix that answered naming it there."""
        for contact in seeds:
            self._known.setdefault(contact.peer_id, contact)

    def _rank(self, contact: Contact) -> tuple[int, bytes | int]:
        """The order a read asks in: the nodes of the prefix first, by a hash of their ids
        keyed with the salt (each drawn first alike, whatever its id), then any other by its
        distance to the key. Which nodes a lookup must hear from (`_closest_live`) is by the
        distance to the key."""
        if not self._inside(contact):
            return (1, contact.id ^ self.target)
        rank = self._order.get(contact.peer_id)
        if rank is None:
            rank = hashlib.blake2b(
                contact.id.to_bytes(32, "big"), key=self._salt, digest_size=16
            ).digest()
            self._order[contact.peer_id] = rank
        return (0, rank)

    def _live(self, peer_id: ID) -> bool:
        """Neither failed nor stalled (a stalled contact that answers later is live again)."""
        return peer_id not in self._failed and peer_id not in self._stalled

    def _closest_live(self) -> list[Contact]:
        live = [c for c in self._known.values() if self._live(c.peer_id)]
        live.sort(key=lambda c: c.id ^ self.target)
        return live[: self._depth(live)]

    def _depth(self, live: list[Contact]) -> int:
        """How many of the nearest `live` contacts (sorted) the lookup asks."""
        if not self.prefix_bits:
            return self.k
        inside = 0  # the prefix's nodes are the nearest ones
        while inside < len(live) and in_prefix(live[inside].id, self.target, self.prefix_bits):
            inside += 1
        return min(self.k, max(self.least, inside + 1))

    def next_queries(self) -> list[Contact]:
        """Contacts to query now; each is marked pending."""
        slots = self.alpha - len(self._pending)
        chosen = []
        closest = self._closest_live()
        if self.read:  # the prefix in the read's own order
            closest.sort(key=self._rank)
        for contact in closest:
            if slots <= 0:
                break
            if contact.peer_id not in self._answered and contact.peer_id not in self._pending:
                chosen.append(contact)
                self._pending.add(contact.peer_id)
                slots -= 1
        return chosen

    def on_answer(self, contact: Contact, closer: Iterable[Contact]) -> None:
        self._pending.discard(contact.peer_id)
        self._stalled.discard(contact.peer_id)
        self._answered.add(contact.peer_id)
        for other in closer:
            if other.peer_id not in self._failed:
                self._known.setdefault(other.peer_id, other)
        if self.read and self._inside(contact):
            closer = list(closer)
            self._cut_answers += all(self._inside(other) for other in closer)
            for other in closer:
                if self._inside(other):
                    named = self._named.setdefault(other.peer_id, {})
                    named.setdefault(other.addrs, set()).add(contact.peer_id)

    def on_failure(self, contact: Contact) -> None:
        self._pending.discard(contact.peer_id)
        self._stalled.discard(contact.peer_id)
        self._failed.add(contact.peer_id)

    def on_stall(self, contact: Contact) -> None:
        """`contact` has not answered for longer than answers take: its slot goes to the next
        contact, and the lookup no longer waits for it. "Nodes that fail to respond quickly are
        removed from consideration until and unless they do respond" (Kademlia, sec. 2.3): its
        answer still counts if it comes while the lookup runs."""
        if contact.peer_id in self._pending:
            self._pending.discard(contact.peer_id)
            self._stalled.add(contact.peer_id)

    def pending(self) -> list[Contact]:
        """Contacts asked that have not answered, failed or stalled."""
        return [self._known[peer_id] for peer_id in self._pending]

    def stalled(self) -> list[Contact]:
        """Contacts whose queries stalled and have not answered or failed since."""
        return [self._known[peer_id] for peer_id in self._stalled]

    @property
    def done(self) -> bool:
        if self.read_enough:
            return True  # what is still pending is cut
        if self._pending:
            return False
        return all(c.peer_id in self._answered for c in self._closest_live())

    def _inside(self, contact: Contact) -> bool:
        return in_prefix(contact.id, self.target, self.prefix_bits)

    @property
    def read_enough(self) -> bool:
        """A read's lookup may end: the first `read` nodes of the prefix in its order
        (`_first_of_prefix`) answered, each naming a node beyond it too, and the prefix shows
        at least `MIN_PREFIX_READ` nodes."""
        if not self.read or self._cut_answers:
            return False
        first = self._first_of_prefix()
        return (
            len(first) == self.read
            and all(c.peer_id in self._answered for c in first)
            and self._prefix_shown() >= MIN_PREFIX_READ
        )

    def _first_of_prefix(self) -> list[Contact]:
        """The first `read` nodes of the prefix we know in the read's order (`_rank`), less
        those that failed or stalled: a read's holders are drawn from the prefix alike, not the
        first to answer (which favours nodes on fast links: at 40 simulated peers the busiest
        node sent 1.60x the mean node's replies so, 1.44x this way; session 43)."""
        inside = [c for c in self._known.values() if self._inside(c) and self._live(c.peer_id)]
        inside.sort(key=self._rank)
        return inside[: self.read]

    def _prefix_shown(self) -> int:
        """The nodes of the prefix that answered, or that `NAMED_BY` of its answers named at
        the same addresses and that have not failed or stalled since (one liar's names count
        for nothing; a node only named may still have left)."""
        shown = 0
        for contact in self._known.values():
            peer_id = contact.peer_id
            if not (self._live(peer_id) and self._inside(contact)):
                continue
            named = self._named.get(peer_id, {})
            shown += peer_id in self._answered or any(len(by) >= NAMED_BY for by in named.values())
        return shown

    def read_holders(self) -> list[Contact]:
        """A read's holders (`read`), the nearest the key first: where it ended early, the
        first nodes of the prefix in its order, each of which answered it
        (`_first_of_prefix`); else those that answered (`closest_answered`). A node only
        named may have left since its neighbours last heard from it, or sit behind a NAT that
        no connection of ours crosses yet: read from at 100 simulated peers, such nodes made a
        hot read's calls 24 % slower than those of full lookups, and the run took 8 steps, not
        13 (seed 0; session 43)."""
        if not self.read_enough:
            return self.closest_answered()
        return sorted(self._first_of_prefix(), key=lambda c: c.id ^ self.target)

    def closest_answered(self) -> list[Contact]:
        """The k closest contacts that answered: where a record lives."""
        return [c for c in self._closest_live() if c.peer_id in self._answered]


class _Failure(NamedTuple):
    addrs: tuple[str, ...]
    until: float
    backoff: float


class Unresponsive:
    """Contacts whose calls failed us lately; a lookup does not ask them again, however many
    other nodes still name them, until their backoff ends.

    A node hears of a departure only through a failed call of its own, and names the departed
    contact in its replies until then. Every lookup toward a key near a departed node learned it
    again from such replies and called it again: in a seeded simulation (100 peers, 200 %/hour
    churn, 5 minutes, seed 0) a node near the progress key that left at 9 s drew 2,808 calls
    from 125 callers, up to 31 from one caller (one per hot store's lookup, every 10 s), each
    after that caller's first call to it had failed; with this memory 365, at most 6 from one.
    A node that left silently costs every such call the whole RPC timeout.

    Evidence is our own failed calls, never a peer's word, and it names a (peer id, addresses)
    pair: a replier that names an honest node at addresses of its own choosing makes our call
    fail, and then that pair is skipped, not the node as others name it. A contact that answers
    us or calls us (an authenticated connection) is alive and leaves at once (`answered`). The
    backoff doubles at each failure after one ends (a node that is still gone), up to
    `max_backoff`; the oldest of more than `size` contacts are forgotten.
    """

    def __init__(self, *, backoff: float, max_backoff: float, size: int) -> None:
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.size = size
        self._failures: OrderedDict[ID, _Failure] = OrderedDict()

    def __len__(self) -> int:
        return len(self._failures)

    def failed(self, contact: Contact, *, now: float) -> None:
        """Our call to `contact` failed (it timed out, or no connection could be made)."""
        backoff = self.backoff
        previous = self._failures.pop(contact.peer_id, None)
        if previous is not None and previous.addrs == contact.addrs:
            if now < previous.until:  # calls made before the first failure came back
                self._failures[contact.peer_id] = previous
                return
            backoff = min(self.max_backoff, 2 * previous.backoff)
        self._failures[contact.peer_id] = _Failure(contact.addrs, now + backoff, backoff)
        while len(self._failures) > self.size:
            self._failures.popitem(last=False)

    def answered(self, peer_id: ID) -> None:
        """`peer_id` answered a call of ours, or called us: it is alive."""
        self._failures.pop(peer_id, None)

    def skips(self, contact: Contact, *, now: float) -> bool:
        """Whether a lookup leaves `contact` out now."""
        failure = self._failures.get(contact.peer_id)
        return failure is not None and failure.addrs == contact.addrs and now < failure.until

    def clear(self) -> None:
        self._failures.clear()
