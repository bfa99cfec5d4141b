"""The DHT node: Kademlia routing plus peertrain's record rules, over the RPC layer.

Reads are always fresh: `get` asks the `replicas` nodes closest to the key and merges their
answers (latest expiration wins), so a reader never serves a copy cached from an earlier read.
`store` writes to the `replicas` closest nodes it can reach. A hot key (progress records,
written and read by every peer every few seconds) reuses its replicas' lookup for a while and
is read from two of them (`get(hot=True)`). A server-mode node also stores and
answers for others; a client-mode node (`peer status`) only asks.

Nothing a peer sends can exhaust a node or hide a key (issue 16): a writer holds a few subkeys
per key and a bounded share of each node (`records.RecordStore`); a get reply carries the
entries that fit `REPLY_BYTES` (`records.select`); a reader takes from any reply only what fits
its own budget, checks each entry once, and drops a reply (and that replica) with more than
`MAX_INVALID_ENTRIES` invalid ones. Handlers never wait: their work is bounded by these limits.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import msgspec
import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from peer.config import DhtConfig
from peer.dht import protocol as p
from peer.dht.records import (
    MAX_INVALID_ENTRIES,
    MAX_REPLY_ENTRIES,
    MAX_TTL,
    MAX_WRITER_BYTES,
    Entry,
    Limits,
    RecordStore,
    entry_bytes,
    live,
    make_entry,
    merge,
    owner_key,
    page_of,
    pages_for,
    select,
    validate_entry,
)
from peer.dht.routing import (
    READ_ANSWERS,
    Contact,
    Lookup,
    RoutingTable,
    Unresponsive,
    hot_holders,
    hot_read_order,
    in_prefix,
    key_id,
    node_id,
    spread_bits,
)
from peer.errors import DeadlineExceeded, ProtocolError, RemoteError, RpcError, Unreachable
from peer.net.host import Node, parse_addrs
from peer.net.ratelimit import ByteBudgets
from peer.net.relayed import is_circuit
from peer.net.rpc import RpcServer

log = logging.getLogger("peertrain.dht")
HANDLER_SECONDS = 10.0  # a DHT call is answered (and its reply read) within this, or reset
#: Seconds between attempts to bootstrap again while no backbone is in our routing table.
REJOIN_INTERVAL = 2.0
#: Attempts to join again through a dropped contact before it is given up on: its addresses
#: are its own claim, and an isolated node must not dial them every 2 s for ever.
REJOIN_ATTEMPTS = 3
#: Contacts a `rejoin` dials at most (the backbones always): each costs a dial and a lookup.
MAX_REJOIN = 32
#: Bytes of one get reply, entries and contacts: it fits a fresh yamux stream's 256 KiB send
#: window, so it is written whole without waiting for the caller to read, and a caller that
#: reads none of its 32 streams (rpc.MAX_STREAMS_PER_PEER) pins at most 6 MiB. ~200 records.
REPLY_BYTES = 192 * 1024
#: Replicas a read takes page by page when a key's entries fill more than one reply (the
#: others' first replies still merge in): a second one covers a replica that lags or lies.
PAGED_REPLICAS = 2
#: Signature checks between two yields to the event loop while a reader checks a reply (~7 ms).
CHECKS_PER_YIELD = 64
#: Replicas a hot read asks (`get(hot=True)`): at random among the key's closest, so a replica
#: that lags or leaves entries out is covered by the other, and the key's load spreads over all
#: of its replicas instead of falling on every one of them at every read.
HOT_READ_REPLICAS = 2
#: Replicas a hot read asks of a key the caller read before (`get_many(known=)`), and one more
#: where that one lacks a record the last read found, or shows fewer owner-signed entries: a
#: reader of the same keys every few seconds asked two at every read, which doubled what every
#: holder sent (at 300 simulated peers, two thirds of the DHT's calls were these reads) against
#: a replica that leaves records out, which the second now covers, or serves them as they were,
#: which a read at another replica drawn at random covers.
CARRIED_READ_REPLICAS = 1
#: Seconds a hot key's closest replicas are reused before they are looked up again. A lookup
#: cost more than the record it stored: ~10 replies of 20 contacts against a 0.7 KB progress
#: record written every second by every trainer. Short, so that nodes that joined closer to
#: the key are written to soon.
HOT_REPLICAS_SECONDS = 10.0
#: The same for a spread key (`routing.spread_key`), whose holders are every node of its prefix:
#: a reader of 2^L shards looks up every one of them, each deeper than 8 replicas (find_node
#: calls at 100 simulated peers: 6.6 a second a node with 8 replicas every 10 s, 12 with
#: prefixes 16 deep every 10 s, 1.2-6.7 with 24 deep every 30 s). A node that joined the prefix
#: since is no holder until then, for writers and readers alike; one that left fails its call
#: and the key is looked up again (`_forget`).
HOT_SPREAD_SECONDS = 30.0
#: Spread keys of one level whose holders are looked up every `HOT_SPREAD_SECONDS`; a level of
#: more keys reuses them longer, in proportion (`spread_refresh_seconds`). A reader looks up
#: every shard of its level, each ~30 find_node calls 24 deep: in the first 30 s of 300
#: simulated peers (32 shards) every node made 58 find_node calls a second (1 GB of them in
#: all, 70 % of the calls), for holders that change with churn alone (one that left fails a
#: call and its key is looked up again; one that joined is read and written to from the next
#: lookup).
SPREAD_KEYS_PER_REFRESH = 8
#: Seconds a spread key's holders are reused, at most: a joiner of the prefix waits at most
#: this long to be written to.
HOT_SPREAD_MAX_SECONDS = 300.0
#: Holders of a spread key a lookup finds, at most, as a multiple of `dht.replicas`: its prefix
#: holds a shard's ~8-16 nodes (`peer.training.shards.SHARD_RECORDS`), more by chance. With
#: 2x, a shard whose prefix held over 16 nodes had 16 holders for more records: the busiest
#: node served 1.44-1.75x the mean at 1,000 peers (by placement, seeds 0-2); with 3x, 1.0-1.17x.
SPREAD_HOLDERS = 3
#: Hot keys whose replicas are remembered (the oldest go): every shard of the progress key a
#: reader reads (`peer.training.shards.MAX_LEVEL`: 1,024) and the few a writer writes, and more.
HOT_KEYS = 1152
#: Seconds a contact whose call timed out or found no connection is left out of our lookups,
#: however many others still name it (`routing.Unresponsive`); doubled at each failure after
#: that, up to `UNRESPONSIVE_MAX_SECONDS`. A node that answers us or calls us is back at once.
UNRESPONSIVE_SECONDS = 60.0
UNRESPONSIVE_MAX_SECONDS = 900.0
#: Unresponsive contacts remembered (the oldest go): departures of a few hours at 200 %/hour.
UNRESPONSIVE_CONTACTS = 256
#: Seconds after which a lookup's find_node query that has not answered stops holding the
#: lookup (`Lookup.on_stall`): a find_node reply is ~2 KB, and lookups' calls to live nodes took
#: 0.1 s on average in the simulation, while a node that left silently holds a lookup for the
#: whole RPC timeout. The stalled contact is then called once more in the background (`_probe`).
STALL_SECONDS = 1.0
#: Stalled contacts probed at once, at most (the others are left to the next lookup).
MAX_PROBES = 16

Clock = Callable[[], float]


@dataclass(frozen=True)
class DhtStatistics:
    contacts: int
    keys_held: int
    stores_received: int
    gets_served: int
    calls: dict[tuple[str, str], int]
    """(method, outcome) -> RPCs this node made; outcome ok, timeout, unreachable or error."""


class DHT:
    def __init__(
        self,
        node: Node,
        config: DhtConfig,
        *,
        server: bool,
        rpc_timeout: float,
        clock: Clock = time.time,
    ) -> None:
        self.node = node
        self.config = config
        self.server = server
        self.rpc_timeout = rpc_timeout
        self.clock = clock
        self.table = RoutingTable(node.peer_id, bucket_size=config.bucket_size)
        self.unresponsive = Unresponsive(
            backoff=UNRESPONSIVE_SECONDS,
            max_backoff=UNRESPONSIVE_MAX_SECONDS,
            size=UNRESPONSIVE_CONTACTS,
        )
        self.records = RecordStore(
            Limits(
                max_value_bytes=config.max_value_bytes,
                max_subkeys=config.max_subkeys,
                max_keys=config.max_keys,
                max_ttl=min(config.max_ttl, MAX_TTL),
                max_clock_skew=config.max_clock_skew,
                max_total_bytes=config.max_store_bytes,
                # Four of the largest values, whatever `max_value_bytes` is set to.
                max_writer_bytes=max(MAX_WRITER_BYTES, 4 * (config.max_value_bytes + 1024)),
            )
        )
        self.reply_bytes = min(REPLY_BYTES, node.rpc.max_message_bytes // 2)
        # What a reader accepts from a replica: twice the clock skew (see `_checked`).
        skew = self.records.limits.max_clock_skew
        self.read_limits = dataclasses.replace(self.records.limits, max_clock_skew=2 * skew)
        self.store_budgets = ByteBudgets(
            capacity=config.caller_store_bytes, window=config.store_window
        )
        self.seeds: list[tuple[ID, Multiaddr]] = []  # backbones to fall back on
        # The table's contacts we dropped last (bounded), each with the attempts left to join
        # again through it if we lose them all.
        self._forgotten: OrderedDict[ID, tuple[Contact, int]] = OrderedDict()
        # Hot keys' holders (key id -> `Holders`): `_hot_replicas`.
        self._hot: OrderedDict[int, Holders] = OrderedDict()
        # Hot keys' entries at their last read (key id -> count): see `_hot_get`.
        self._hot_read: OrderedDict[int, int] = OrderedDict()
        self._probes: trio.Nursery | None = None  # `run`'s: where `_probe` calls go on
        self._probing: set[ID] = set()
        self.lookup_seconds = 0.0
        """How long our lookups take (a moving average): what a hot store saves."""
        self.announcing: Callable[[], bool] = lambda: True
        """Whether we tell callees our addresses (server mode), so they add us to their tables:
        a peer's daemon says so only once a backbone could dial it. Behind NAT, others' lookups
        waited out a dial to us at every hop (a home router drops the SYN: 5 s each)."""
        self.rng: random.Random = random.SystemRandom()
        """A read's salt and the replicas it asks: what strangers must not predict (a Mersenne
        Twister's state can be recovered from enough of its outputs). The simulator seeds its
        own."""
        self._stores_received = 0
        self._gets_served = 0
        self._calls: Counter[tuple[str, str]] = Counter()
        rpc = RpcServer(
            node.host,
            p.SERVICE,
            max_message_bytes=node.rpc.max_message_bytes,
            call_deadline=HANDLER_SECONDS,
        )
        rpc.add_unary("find_node", p.FindNode, self._on_find_node)
        rpc.add_unary("store", p.Store, self._on_store)
        rpc.add_unary("get", p.Get, self._on_get)

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background upkeep: purge expired entries, refresh the routing table, and join again
        when we lost touch (checked every REJOIN_INTERVAL, whatever the purge interval); and
        the probes of contacts that stalled our lookups (`_probe`)."""
        async with trio.open_nursery() as probes:
            self._probes = probes
            try:
                task_status.started()
                await self._upkeep()
            finally:
                self._probes = None

    async def _upkeep(self) -> None:
        next_purge = trio.current_time() + self.config.purge_interval
        next_refresh = trio.current_time() + self.config.refresh_interval
        while True:
            await trio.sleep(min(self.config.purge_interval, REJOIN_INTERVAL))
            if trio.current_time() >= next_purge:
                next_purge = trio.current_time() + self.config.purge_interval
                purged = self.records.purge(now=self.clock())
                if purged:
                    log.debug("purged %d expired entries", purged)
            if rejoin := self._rejoin_candidates():
                if len(self.table) == 0:  # every call failed: our own network, likely
                    self.unresponsive.clear()
                reached = await self.bootstrap(rejoin)
                self._count_rejoin_attempts(rejoin, reached)
            elif trio.current_time() >= next_refresh:
                next_refresh = trio.current_time() + self.config.refresh_interval
                await self.find_nodes(random.getrandbits(256))

    def _rejoin_candidates(self) -> list[tuple[ID, Multiaddr]]:
        """Whom to bootstrap from again, if we lost touch: every backbone once none is left in
        our table (they may be back: a restart, a healed partition), and the contacts we dropped
        last once the table is empty (a burst of failed calls, e.g. a connection py-libp2p
        closed under several streams, dropped them all at once; until then our reads see only
        ourselves and we would never hear of the others again)."""
        candidates = list(self.seeds) if self._lost_backbones() else []
        if len(self.table) == 0:
            chosen = {peer_id for peer_id, _ in candidates}
            for peer_id, (contact, _) in self._forgotten.items():
                addrs = parse_addrs(contact.addrs)
                if addrs and peer_id not in chosen:
                    candidates.append((peer_id, addrs[0]))
        return candidates

    def _count_rejoin_attempts(
        self, tried: Sequence[tuple[ID, Multiaddr]], reached: Sequence[ID]
    ) -> None:
        """Dropped contacts that answered are back in the table; one that did not has one
        attempt less, and none left: it is given up on."""
        for peer_id, _ in tried:
            if peer_id not in self._forgotten:
                continue
            contact, left = self._forgotten.pop(peer_id)
            if peer_id not in reached and left > 1:
                self._forgotten[peer_id] = (contact, left - 1)

    def _lost_backbones(self) -> bool:
        return bool(self.seeds) and not any(peer_id in self.table for peer_id, _ in self.seeds)

    async def rejoin(self, known: Sequence[tuple[ID, Multiaddr]] = ()) -> list[ID]:
        """Join again, whatever our table holds: through every backbone, our table's
        contacts, those we dropped last and `known` (peers whose records we read, most useful
        first; their own word, so last: records cannot push our contacts out), at most
        `MAX_REJOIN` of them; the hot keys' replicas are looked up afresh.
        For a caller that sees nobody for a while (`StepPolicy.out_of_touch`): the upkeep
        joins again only once no backbone is left in the table, or nothing at all, and a
        table of contacts that answer us but no longer hold what the others write (they
        died and came back, a partition healed on one side) kept a peer reading only itself.
        Returns those that answered."""
        candidates: dict[ID, Multiaddr] = {}
        table = [(c.peer_id, c.addrs) for c in self.table.contacts()]
        forgotten = [(peer_id, c.addrs) for peer_id, (c, _) in self._forgotten.items()]
        for peer_id, texts in [*table, *forgotten]:
            addrs = direct_addrs(texts)
            if addrs and peer_id != self.node.peer_id:
                candidates.setdefault(peer_id, addrs[0])
        chosen = dict(self.seeds)
        for peer_id, addr in [*candidates.items(), *known]:
            if len(chosen) >= MAX_REJOIN:
                break
            if peer_id != self.node.peer_id:
                chosen.setdefault(peer_id, addr)
        self._hot.clear()
        self._hot_read.clear()
        # We see nobody: the failed calls may have been our own network's fault.
        self.unresponsive.clear()
        return await self.bootstrap(list(chosen.items()))

    async def bootstrap(self, seeds: Sequence[tuple[ID, Multiaddr]]) -> list[ID]:
        """Contact seed nodes (backbones), then look ourselves up to fill the routing table.

        Returns the seeds that answered; an empty list means none did.
        """
        reached: list[ID] = []

        async def contact(peer_id: ID, addr: Multiaddr) -> None:
            try:
                await self.node.connect(peer_id, [addr], timeout=self.rpc_timeout)
                nodes = await self._call(
                    peer_id,
                    "find_node",
                    p.FindNode(self._own_target(), self._caller_addrs()),
                    p.Nodes,
                )
            except RemoteError as error:
                log.debug("seed %s did not answer: %s", peer_id, error)
                return
            self._learn(Contact(peer_id, (str(addr),)))
            now = trio.current_time()
            for other in p.to_contacts(nodes.nodes, exclude=self.node.peer_id):
                # The seed's word: into the table, but neither proof that it is alive nor
                # enough to bring back a contact that failed our own calls.
                if not self.unresponsive.skips(other, now=now):
                    self._learn(other, answered=False)
            reached.append(peer_id)

        async with trio.open_nursery() as nursery:
            for peer_id, addr in seeds:
                nursery.start_soon(contact, peer_id, addr)
        if reached:
            await self.find_nodes(node_id(self.node.peer_id))
        return reached

    def statistics(self) -> DhtStatistics:
        return DhtStatistics(
            len(self.table),
            len(self.records),
            self._stores_received,
            self._gets_served,
            dict(self._calls),
        )

    # ------------------------------------------------------------------ public operations

    async def store(
        self, key: str, subkey: str, value: bytes | None, *, expiration: float, hot: bool = False
    ) -> int:
        """Store (key, subkey) -> value until `expiration`; returns how many replicas kept it.

        A subkey equal to our own peer id is signed with our key (an owner-signed entry). A
        `hot` key, written every few seconds, goes to its holders as looked up at most
        `HOT_REPLICAS_SECONDS` (`spread_refresh_seconds`) ago (`_hot_replicas`).
        """
        signer = (
            self.node.identity.key_pair.private_key
            if subkey == self.node.peer_id.to_base58()
            else None
        )
        return await self.store_entries(
            key, {subkey: make_entry(key, subkey, value, expiration, signer=signer)}, hot=hot
        )

    async def withdraw(self, key: str, subkey: str, *, expiration: float, hot: bool = False) -> int:
        """Delete (key, subkey) with a tombstone; `expiration` must exceed the live entry's."""
        return await self.store(key, subkey, None, expiration=expiration, hot=hot)

    async def store_entries(self, key: str, entries: dict[str, Entry], *, hot: bool = False) -> int:
        target = key_id(key)
        bits = 0
        if hot and self._large():
            bits = spread_bits(key)
            targets = list(await self._hot_replicas(target, bits, read=False))
        else:
            targets = (await self.find_nodes(target)).closest_answered()[: self.config.replicas]
        accepted = 0
        if self._replica() and self._we_belong_among(target, targets, bits):
            # We are one of the holders: keep a copy and, of `replicas` or more, drop the
            # farthest remote (unless the holders are the key's prefix, which we join), so the
            # record lives on exactly the nodes a reader's lookup will ask.
            if not (targets and in_prefix(targets[-1].id, target, bits)):
                targets = targets[: self.config.replicas - 1]
            me = self.node.peer_id.to_base58()
            try:
                accepted += any(
                    self.records.store(key, s, e, now=self.clock(), writer=me)
                    for s, e in entries.items()
                )
            except ProtocolError as error:
                log.debug("local store refused %s: %s", key, error)
        request = p.Store(key, entries, self._caller_addrs())
        replies = await self._call_each([(c, request) for c in targets], "store", p.StoreReply)
        for contact, reply in zip(targets, replies, strict=True):
            if isinstance(reply, RemoteError):
                self._forget(contact, reply)
            else:
                accepted += any(v in ("stored", "kept-newer") for v in reply.verdicts.values())
        return accepted

    async def get(self, key: str, *, hot: bool = False, strict: bool = False) -> dict[str, Entry]:
        """The entries of `key` live when the read began, merged from the closest replicas
        (fresh, never cached). Replicas drop what has expired when they answer; judging the
        rest by the time the read ends would lose every record whose TTL is shorter than a
        slow lookup (the chaos suite saw a 5 s read under load return one record of five).

        A `hot` key, read every few seconds by every peer (progress records), is read whole
        from `HOT_READ_REPLICAS` of its closest replicas, chosen at random, without a lookup
        while the replicas looked up last are fresh (`_hot_replicas`). At 300 simulated
        trainers a full read of the progress key cost every replica and every node on the
        lookup's path a 192 KiB reply, every second, from every trainer.

        `strict`: Unreachable where no node answered the read and we hold no copy of the key
        as a replica: an empty answer, not an empty key (a reader counting what it read)."""
        entries = (await self.get_many([key], hot=hot, strict=strict))[key]
        if isinstance(entries, RemoteError):
            raise entries
        return entries

    async def get_many(
        self,
        keys: Sequence[str],
        *,
        hot: bool = False,
        strict: bool = False,
        known: Mapping[str, Mapping[str, Entry]] | None = None,
    ) -> dict[str, dict[str, Entry] | RemoteError]:
        """`get` of every key at once: each key's entries, or the RemoteError its read met
        (`strict`: Unreachable where nobody answered). Hot keys' replicas are asked in one
        fan-out (`_hot_get`: a progress read of 2^L shards is one `call_each`, not 2^L reads).

        `known`: entries this caller's last read of each key found, validated then (a reader of
        the same keys every few seconds: its owner-signed records). A hot key in it is read
        from `CARRIED_READ_REPLICAS` replica, and from another where that one lacks an entry of
        `known` still live or holds fewer owner-signed entries than our last read; entries
        equal to one of `known` are not validated again. The answer is the replicas'; whether
        to merge `known` into it is the caller's."""
        started = self.clock()
        keys = list(dict.fromkeys(keys))
        merged: dict[str, dict[str, Entry]] = {key: {} for key in keys}
        if self.server:
            for key in keys:
                merge(merged[key], self.records.get(key, now=started))
        done = await self._hot_get(keys, merged, known) if hot and self._large() else set()
        failed: dict[str, RemoteError] = {}

        async def read(key: str) -> None:
            try:
                await self._lookup_get(key, merged[key], hot=hot, strict=strict)
            except RemoteError as error:
                failed[key] = error

        rest = [key for key in keys if key not in done]
        if len(rest) == 1:
            await read(rest[0])
        else:
            async with trio.open_nursery() as nursery:
                for key in rest:
                    nursery.start_soon(read, key)
        return {key: failed.get(key) or live(merged[key], now=started) for key in keys}

    async def _lookup_get(
        self, key: str, merged: dict[str, Entry], *, hot: bool, strict: bool
    ) -> None:
        """`key`'s entries from every replica a lookup meets, into `merged`."""
        request = p.Get(key, self._caller_addrs())
        paged: list[Contact] = []  # replicas we read page by page
        answered = 0

        async def query(contact: Contact) -> list[Contact]:
            nonlocal answered
            reply = await self._call(contact.peer_id, "get", request, p.GetReply)
            answered += 1
            merge(merged, await self._checked(key, reply.entries, known=merged))
            if reply.pages > 1 and len(paged) < PAGED_REPLICAS:
                paged.append(contact)
                await self._read_pages(contact, key, reply.pages, merged)
            return p.to_contacts(reply.nodes, exclude=self.node.peer_id)

        await self._lookup(key_id(key), query)
        if strict and not answered and not (self._replica() and merged):
            raise Unreachable(f"no DHT node answered a read of {key!r}")
        if hot:
            self._note_hot_read(key_id(key), owned_entries(merged))

    async def _hot_get(
        self,
        keys: list[str],
        merged: dict[str, dict[str, Entry]],
        known: Mapping[str, Mapping[str, Entry]] | None = None,
    ) -> set[str]:
        """Read each key whole (every page) from `HOT_READ_REPLICAS` of its holders at random
        (`_hot_replicas`; those of its prefix first), into `merged`, all keys' calls at once; a
        replica that fails is replaced by another of them. A key the caller read before
        (`known`), from `CARRIED_READ_REPLICAS`, and one more where the first lacked a live
        entry of `known` or held fewer owned entries than our last read (`_hot_read`); entries
        equal to one of `known` are not checked again. The keys read this way: not one
        none of whose replicas answered, nor one whose replicas held fewer than half the
        entries of our last read of it: the caller reads those the usual way, from every
        replica its lookup meets. (Replicas that took the place of departed ones hold only what
        was written since, until every writer has written again: two of them alone would hide
        the rest.)"""
        replicas = await self._hot_replicas_of(keys)
        me = self.node.peer_id
        known = known or {}
        wanted: dict[str, int] = {}
        candidates: dict[str, list[Contact]] = {}
        for key in keys:
            target, bits = key_id(key), spread_bits(key)
            asked = CARRIED_READ_REPLICAS if key in known else HOT_READ_REPLICAS
            # We are a replica ourselves (our copy is merged already): one remote read fewer,
            # never none (our copy lags where a store to us failed).
            wanted[key] = max(
                1, asked - (self._replica() and self._holds(target, bits, replicas[key]))
            )
            # A spread key's holders of its prefix first, where they are enough (read from the
            # others alike, those served 1.9x the mean node by placement at 300 and 1,000).
            others = [c for c in replicas[key] if c.peer_id != me]
            candidates[key] = hot_read_order(target, bits, others, self.rng.shuffle)
        answered = dict.fromkeys(keys, 0)
        addrs = self._caller_addrs()
        short: set[str] = set()  # keys asked one more replica (`_short`)
        # A replica's further pages are read beside the next batch, not before it: a replica
        # that stalls its pages must not hold every other key's replacement reads.
        async with trio.open_nursery() as pages:
            while batch := self._next_hot_batch(keys, wanted, answered, candidates):
                await self._hot_batch(batch, addrs, merged, answered, pages, known)
                for key in dict.fromkeys(k for k, _ in batch if k in known):
                    if key not in short and answered[key] and self._short(key, merged, known):
                        short.add(key)
                        wanted[key] += 1
        done: set[str] = set()
        for key in keys:
            target, owned = key_id(key), owned_entries(merged[key])
            if (answered[key] == 0 and wanted[key] > 0) or 2 * owned < self._hot_read.get(
                target, 0
            ):
                # Holders that hid records (or joined since and hold few yet) are looked up
                # again at the next use, not reused for up to `HOT_SPREAD_MAX_SECONDS` (review).
                self._hot.pop(target, None)
                continue
            self._note_hot_read(target, owned)
            done.add(key)
        return done

    def _short(
        self,
        key: str,
        merged: dict[str, dict[str, Entry]],
        known: Mapping[str, Mapping[str, Entry]],
    ) -> bool:
        """Whether a carried read of `key` asks one more replica: what it got lacks a live
        entry the caller's last read found, or holds fewer owned entries than our last read."""
        now, got = self.clock(), merged[key]
        lacks = any(sub not in got and e.expiration > now for sub, e in known[key].items())
        return lacks or owned_entries(got) < self._hot_read.get(key_id(key), 0)

    @staticmethod
    def _next_hot_batch(
        keys: list[str],
        wanted: dict[str, int],
        answered: dict[str, int],
        candidates: dict[str, list[Contact]],
    ) -> list[tuple[str, Contact]]:
        """The (key, replica) reads due now: each key's next candidates, as many as it lacks."""
        batch: list[tuple[str, Contact]] = []
        for key in keys:
            take = candidates[key][: max(0, wanted[key] - answered[key])]
            del candidates[key][: len(take)]
            batch += [(key, contact) for contact in take]
        return batch

    async def _hot_batch(
        self,
        batch: list[tuple[str, Contact]],
        addrs: list[str] | None,
        merged: dict[str, dict[str, Entry]],
        answered: dict[str, int],
        pages: trio.Nursery,
        known: Mapping[str, Mapping[str, Entry]],
    ) -> None:
        """One fan-out of hot reads, into `merged`; a replica that fails is forgotten, one
        whose key fills more than a reply is read page by page in `pages`. An entry equal to
        one read now or in the caller's last read (`known`) is not validated again."""
        replies = await self._call_each(
            [(contact, p.Get(key, addrs, contacts=False)) for key, contact in batch],
            "get",
            p.GetReply,
        )
        for (key, contact), reply in zip(batch, replies, strict=True):
            try:
                if isinstance(reply, RemoteError):
                    raise reply
                merge(
                    merged[key],
                    await self._checked(key, reply.entries, known=merged[key], also=known.get(key)),
                )
            except RemoteError as error:
                self._forget(contact, error)
                continue
            answered[key] += 1
            if reply.pages > 1:
                pages.start_soon(self._read_pages, contact, key, reply.pages, merged[key])

    async def _hot_replicas_of(self, keys: list[str]) -> dict[str, list[Contact]]:
        """`_hot_replicas` of every key: those remembered at once, the rest looked up together."""
        found: dict[str, list[Contact]] = {}
        for key in keys:
            cached = self._fresh_hot(key_id(key))
            if cached is not None:
                found[key] = cached

        async def look_up(key: str) -> None:
            found[key] = await self._hot_replicas(key_id(key), spread_bits(key), read=True)

        async with trio.open_nursery() as nursery:
            for key in keys:
                if key not in found:
                    nursery.start_soon(look_up, key)
        return found

    def _note_hot_read(self, target: int, entries: int) -> None:
        self._hot_read.pop(target, None)
        self._hot_read[target] = entries
        while len(self._hot_read) > HOT_KEYS:
            self._hot_read.popitem(last=False)

    def _replica(self) -> bool:
        """Whether others may store on us and read from us: a server that announces itself. A
        server that does not is no replica: its copy of a key counts for no one else."""
        return self.server and self.announcing()

    def looks_up(self, key: str) -> bool:
        """Whether a hot store of `key` would look its replicas up now."""
        cached = self._hot.get(key_id(key))
        fresh = cached is not None and cached.complete and trio.current_time() < cached.until
        return not (self._large() and fresh)

    def _large(self) -> bool:
        """Enough nodes for a key's replicas to be a few of them: below, reads and stores of hot
        keys are as any other (a small collaboration's lookups are cheap, and its every node
        holds every key)."""
        return len(self.table) >= self.config.replicas

    def _fresh_hot(self, target: int, *, read: bool = True) -> list[Contact] | None:
        """A hot key's holders as looked up last, while they are fresh; for a store
        (`read` False), only from a lookup that heard from them all."""
        cached = self._hot.get(target)
        if cached is None or trio.current_time() >= cached.until or not (read or cached.complete):
            return None
        self._hot.move_to_end(target)
        return cached.contacts

    async def _hot_replicas(self, target: int, bits: int = 0, *, read: bool) -> list[Contact]:
        """The live nodes that hold a hot key (`routing.hot_holders`: the `replicas` closest
        to `target`, or every node of a spread key's prefix), looked up at most
        `HOT_REPLICAS_SECONDS` (`spread_refresh_seconds`) ago, or again after one of them failed a
        call (`_forget`). A `read` of a spread key may take as holders the few nodes of the
        prefix its lookup heard from (`Lookup.read_holders`); a store asks every holder it
        stores to (it must reach them all, and a reader's list holds a few of them)."""
        cached = self._fresh_hot(target, read=read)
        if cached is not None:
            return cached
        now = trio.current_time()
        k = SPREAD_HOLDERS * self.config.replicas if bits else self.config.replicas
        lookup = await self.find_nodes(target, k=k, spread=bits, read=read)
        early = lookup.read_enough  # a read's, from a few of the prefix: `Lookup.read_holders`
        closest = lookup.read_holders()
        contacts = closest[: hot_holders(target, bits, closest, self.config.replicas)]
        # Fewer than `replicas` answered: our table is filling, the closest nodes are still
        # to be found; looked up at every use.
        if early or len(contacts) >= self.config.replicas:
            self._hot[target] = Holders(
                now + (spread_refresh_seconds(bits) if bits else HOT_REPLICAS_SECONDS),
                contacts,
                complete=not early,
            )
            self._hot.move_to_end(target)
            while len(self._hot) > HOT_KEYS:
                self._hot.popitem(last=False)
        return contacts

    async def _read_pages(
        self, contact: Contact, key: str, pages: int, merged: dict[str, Entry]
    ) -> None:
        """Every page of `key` from one replica whose first reply left entries out (at most
        `p.MAX_PAGES`, however many it claims), into `merged`. A page that fails is missed,
        and the replica's first reply still counts."""

        async def page(index: int) -> None:
            request = p.Get(key, self._caller_addrs(), page=index, pages=pages, contacts=False)
            try:
                reply = await self._call(contact.peer_id, "get", request, p.GetReply)
                merge(merged, await self._checked(key, reply.entries, known=merged))
            except RemoteError as error:
                log.debug("page %d/%d of %r from %s: %s", index, pages, key, contact, error)

        async with trio.open_nursery() as nursery:
            for index in range(min(pages, p.MAX_PAGES)):
                nursery.start_soon(page, index)

    async def _checked(
        self,
        key: str,
        entries: Mapping[str, Entry],
        *,
        known: Mapping[str, Entry],
        also: Mapping[str, Entry] | None = None,
    ) -> dict[str, Entry]:
        """What we take from a replica's reply: the entries that fit our own reply budget (a
        replica that sent more keeps its place; we take what fits), each validated as if stored
        here, except those equal to one `known` (validated already, from another replica) or,
        for a subkey `known` lacks, to one of `also` (our last read's).

        Raises ProtocolError at the `MAX_INVALID_ENTRIES`th invalid entry: an honest replica
        validated all it holds, and a liar must not make us check thousands of signatures.
        """
        taken = select(entries, budget=self.reply_bytes, max_entries=MAX_REPLY_ENTRIES)
        now = self.clock()
        # A replica accepts expirations up to its own clock + max_ttl + skew; ours may be behind
        # its clock by up to that skew, so we allow twice it: else eight entries stored at the
        # edge made us drop an honest replica's whole reply.
        limits = self.read_limits
        valid: dict[str, Entry] = {}
        invalid = checked = 0
        last = also or {}
        for subkey, entry in taken.items():
            # Two lookups, not a ChainMap's (its Python-level `get` was 2.5 % of a 1,000-peer
            # simulation's CPU).
            seen = known.get(subkey)
            if (seen if seen is not None else last.get(subkey)) == entry:
                valid[subkey] = entry
                continue
            checked += 1
            if checked % CHECKS_PER_YIELD == 0:
                await trio.sleep(0)
            try:
                validate_entry(key, subkey, entry, now=now, limits=limits)
            except ProtocolError as error:
                invalid += 1
                if invalid >= MAX_INVALID_ENTRIES:
                    raise ProtocolError(
                        f"{invalid} invalid entries of {key!r} in one reply; the last: {error}"
                    ) from error
                log.debug("dropping an invalid entry of %r: %s", key, error)
                continue
            valid[subkey] = entry
        return valid

    async def find_nodes(
        self, target: int, *, k: int | None = None, spread: int = 0, read: bool = False
    ) -> Lookup:
        """The lookup of `target`'s `k` closest nodes (`dht.replicas`), not held by a query
        that stalls; for a spread key of `spread` bits, of its prefix's nodes and at least
        `dht.replicas`, at most `k` (`Lookup`); to `read` it, the prefix asked in an order of
        our own and, where the prefix shows enough nodes (`Lookup.read_enough`), until the
        first `READ_ANSWERS` of it in that order answered."""

        async def query(contact: Contact) -> list[Contact]:
            reply = await self._call(
                contact.peer_id,
                "find_node",
                p.FindNode(target.to_bytes(32, "big"), self._caller_addrs()),
                p.Nodes,
            )
            return p.to_contacts(reply.nodes, exclude=self.node.peer_id)

        return await self._lookup(
            target, query, stall=STALL_SECONDS, k=k, spread=spread, read=read and spread > 0
        )

    # ------------------------------------------------------------------ lookup shell

    async def _lookup(
        self,
        target: int,
        query: Callable[[Contact], Awaitable[list[Contact]]],
        *,
        stall: float = math.inf,
        k: int | None = None,
        spread: int = 0,
        read: bool = False,
    ) -> Lookup:
        """Run a lookup; a query pending for `stall` seconds no longer holds it, and is cut
        when the lookup is done (its contact then probed: `_probe`). A get's queries carry
        the replicas' entries, and are waited for (`stall` infinite)."""
        k = k or self.config.replicas
        started = trio.current_time()
        lookup = Lookup(
            target,
            self.table.nearest(target, k),
            k=k,
            alpha=self.config.alpha,
            prefix_bits=spread,
            least=self.config.replicas,
            read=READ_ANSWERS if read else 0,
            salt=self.rng.randbytes(16) if read else b"",
        )
        finished_send, finished_recv = trio.open_memory_channel[None](float("inf"))

        async def ask(contact: Contact) -> None:
            try:
                if self.unresponsive.skips(contact, now=trio.current_time()):
                    lookup.on_failure(contact)  # another lookup's call to it failed meanwhile
                    return
                closer = await query(contact)
            except RemoteError as error:
                lookup.on_failure(contact)
                self._forget(contact, error)
            else:
                # Those whose calls failed us stay out, however many replies name them: the
                # repliers have not called them since they left (`routing.Unresponsive`).
                now = trio.current_time()
                closer = [c for c in closer if not self.unresponsive.skips(c, now=now)]
                lookup.on_answer(contact, closer)
                self._learn(contact)
                for other in closer:
                    self._learn_later(other)
            finally:
                finished_send.send_nowait(None)

        asked: dict[ID, float] = {}  # when each query started
        async with trio.open_nursery() as nursery:
            while True:
                for contact in lookup.next_queries():
                    asked[contact.peer_id] = trio.current_time()
                    nursery.start_soon(ask, contact)
                if lookup.done:
                    break
                pending = lookup.pending()
                stalls_at = min((asked[c.peer_id] + stall for c in pending), default=math.inf)
                with trio.move_on_at(stalls_at):
                    await finished_recv.receive()
                    continue
                # Every lookup of 5 s or more (112 of 3,442 in a seeded 100-peer run) waited
                # on a node that left silently, ~4.6 s after its last live answer; with the
                # stall, no find_node lookup took 5 s (p99 1.1-1.5 s).
                for contact in pending:
                    if trio.current_time() >= asked[contact.peer_id] + stall:
                        lookup.on_stall(contact)
            stalled = lookup.stalled()
            nursery.cancel_scope.cancel()  # only stalled queries are left, or a read's pending
        for contact in stalled:
            self._probe(contact)
        if not read:  # what a store's lookup takes (a read's ends early)
            took = trio.current_time() - started
            first = self.lookup_seconds == 0.0
            self.lookup_seconds = took if first else 0.8 * self.lookup_seconds + 0.2 * took
        return lookup

    # ------------------------------------------------------------------ handlers

    async def _on_find_node(self, caller: ID, request: p.FindNode) -> p.Nodes:
        self._note_caller(caller, request.caller_addrs)
        target = int.from_bytes(request.target, "big")
        nearest = self.table.nearest(target, self.config.bucket_size, exclude=[caller])
        return p.Nodes([p.WireContact.of(c) for c in nearest])

    async def _on_store(self, caller: ID, request: p.Store) -> p.StoreReply:
        self._note_caller(caller, request.caller_addrs)
        self._stores_received += 1
        verdicts = {}
        now = self.clock()
        size = sum(entry_bytes(request.key, s, e) for s, e in request.entries.items())
        wait = self.store_budgets.try_spend(caller, size, now=now)
        if wait > 0:
            raise RpcError("unavailable", f"store budget spent; retry in {wait:.0f} s")
        writer = caller.to_base58()
        for subkey, entry in request.entries.items():
            try:
                kept = self.records.store(request.key, subkey, entry, now=now, writer=writer)
                verdicts[subkey] = "stored" if kept else "kept-newer"
            except ProtocolError as error:
                verdicts[subkey] = f"rejected: {error}"
        return p.StoreReply(verdicts)

    async def _on_get(self, caller: ID, request: p.Get) -> p.GetReply:
        self._note_caller(caller, request.caller_addrs)
        self._gets_served += 1
        target = key_id(request.key)
        # More contacts than the caller keeps: some may be dead, and the caller must still
        # find the `replicas` closest live ones.
        nearest = (
            self.table.nearest(target, self.config.bucket_size, exclude=[caller])
            if request.contacts
            else []
        )
        nodes = [p.WireContact.of(c) for c in nearest]
        # Contacts first (at most bucket_size x 16 addresses), entries in what is left.
        budget = self.reply_bytes - len(msgspec.msgpack.encode(nodes))
        entries = self.records.get(request.key, now=self.clock())
        if request.pages > 1:
            if request.page >= request.pages:
                raise RpcError("bad_request", f"page {request.page} of {request.pages}")
            entries = {
                subkey: entry
                for subkey, entry in entries.items()
                if page_of(subkey, request.pages) == request.page
            }
        chosen = select(entries, budget=budget, max_entries=MAX_REPLY_ENTRIES)
        pages = request.pages
        if len(chosen) < len(entries):  # more than one reply holds: say how many pages would
            pages = min(p.MAX_PAGES, request.pages * pages_for(entries, budget=budget))
        return p.GetReply(chosen, nodes, max(pages, request.pages))

    # ------------------------------------------------------------------ helpers

    def _probe(self, contact: Contact) -> None:
        """Call a contact that stalled a lookup once more, in the background, with the whole
        RPC timeout: the evidence that it is gone (`_forget`, `Unresponsive`) or alive
        (`_learn`) that the cut query could not give. Without it a node that left silently
        would cost every lookup near it `STALL_SECONDS`, for as long as others name it.
        Nothing is probed outside `run` (a client that only asks)."""
        if (
            self._probes is None
            or contact.peer_id in self._probing
            or len(self._probing) >= MAX_PROBES
        ):
            return
        self._probing.add(contact.peer_id)
        self._probes.start_soon(self._probe_now, contact)

    async def _probe_now(self, contact: Contact) -> None:
        request = p.FindNode(self._own_target(), self._caller_addrs())
        try:
            await self._call(contact.peer_id, "find_node", request, p.Nodes)
        except RemoteError as error:
            self._forget(contact, error)
        else:
            self._learn(contact)
        finally:
            self._probing.discard(contact.peer_id)

    async def _call(self, peer_id: ID, method: str, request: object, reply_type: type):
        try:
            reply = await self.node.rpc.call(
                peer_id, p.SERVICE, method, request, reply_type, timeout=self.rpc_timeout
            )
        except RemoteError as error:
            self._calls[method, _outcome(error)] += 1
            if isinstance(error, DeadlineExceeded):
                await self.node.disconnect(peer_id)  # it may be a connection the network cut
            raise
        self._calls[method, "ok"] += 1
        return reply

    async def _call_each(
        self, calls: list[tuple[Contact, object]], method: str, reply_type: type
    ) -> list:
        """`method` on each (contact, request) at once: each reply or RemoteError, in order."""
        outcomes = await self.node.rpc.call_each(
            [(contact.peer_id, request) for contact, request in calls],
            p.SERVICE,
            method,
            reply_type,
            timeout=self.rpc_timeout,
        )
        cut: dict[ID, None] = {}  # timed out: it may be a connection the network cut
        for (contact, _), outcome in zip(calls, outcomes, strict=True):
            failed = isinstance(outcome, RemoteError)
            self._calls[method, _outcome(outcome) if failed else "ok"] += 1
            if isinstance(outcome, DeadlineExceeded):
                cut[contact.peer_id] = None
        async with trio.open_nursery() as nursery:  # each may take a second: at once
            for peer_id in cut:
                nursery.start_soon(self.node.disconnect, peer_id)
        return outcomes

    def _caller_addrs(self) -> list[str] | None:
        if not self._replica():
            return None
        return [str(a) for a in self.node.announce]

    def _own_target(self) -> bytes:
        return node_id(self.node.peer_id).to_bytes(32, "big")

    def _note_caller(self, caller: ID, addrs: list[str] | None) -> None:
        if addrs:
            self._learn(Contact(caller, tuple(addrs)))

    def _learn(self, contact: Contact, *, answered: bool = True) -> None:
        """Add a contact that answered us or called us (or, not `answered`, one a seed named
        while we bootstrap), and let the host dial it."""
        if answered:
            self.unresponsive.answered(contact.peer_id)
        known = self.table.get(contact.peer_id)
        if known is None or known.addrs != contact.addrs:
            addrs = direct_addrs(contact.addrs)
            if not addrs:
                return
            self.node.remember_addrs(contact.peer_id, addrs)
        self.table.add(contact)

    def _learn_later(self, contact: Contact) -> None:
        """A contact someone else told us about: dialable, but not in the table until it answers."""
        if contact.peer_id not in self.table:
            addrs = direct_addrs(contact.addrs)
            if addrs:
                self.node.remember_addrs(contact.peer_id, addrs)

    def _forget(self, contact: Contact, error: Exception) -> None:
        log.debug("dropping contact %s: %s", contact.peer_id, error)
        if isinstance(error, DeadlineExceeded | Unreachable):  # it did not answer: gone?
            self.unresponsive.failed(contact, now=trio.current_time())
        # Only table contacts (they answered us, or called us giving these addresses), not
        # addresses others told us about; the newest drop replaces an older one.
        known = self.table.get(contact.peer_id)
        if known is not None:
            self._forgotten.pop(known.peer_id, None)
            self._forgotten[known.peer_id] = (known, REJOIN_ATTEMPTS)
            while len(self._forgotten) > self.config.bucket_size:
                self._forgotten.popitem(last=False)
        self.table.remove(contact.peer_id)
        self.node.rpc.forget(contact.peer_id)
        for target, holders in list(self._hot.items()):
            if any(c.peer_id == contact.peer_id for c in holders.contacts):
                del self._hot[target]  # looked up again at its next use

    def _holds(self, target: int, bits: int, holders: list[Contact]) -> bool:
        """Whether we hold the hot key at `target` beside `holders`, as a read looked them up:
        a read's list of the prefix alone (`Holders.complete` false) does not say which nodes
        beyond it hold the key too, so there only a node of the prefix knows it does."""
        cached = self._hot.get(target)
        if cached is not None and not cached.complete:
            return in_prefix(self.table.own, target, bits)
        return self._we_belong_among(target, holders, bits)

    def _we_belong_among(self, target: int, contacts: list[Contact], bits: int = 0) -> bool:
        """Whether we hold the key at `target` beside `contacts` (the other holders): we share
        its spread prefix and its holders are fewer than a lookup finds, or we are nearer than
        one of them. (Past `SPREAD_HOLDERS` x `replicas` of a prefix, writers store to the
        nearest alone: a farther node of the prefix holds only its own record.)"""
        if len(contacts) < self.config.replicas or (
            in_prefix(self.table.own, target, bits)
            and len(contacts) < SPREAD_HOLDERS * self.config.replicas
        ):
            return True
        return self.table.own ^ target < max(c.id ^ target for c in contacts)


class Holders(NamedTuple):
    """A hot key's holders as a lookup found them (`DHT._hot_replicas`)."""

    until: float
    """Fresh until then."""
    contacts: list[Contact]
    complete: bool
    """The list holds every holder the lookup found (a read's that ended early holds a few of
    the prefix's: `Lookup.read_holders`)."""


def spread_refresh_seconds(bits: int) -> float:
    """Seconds the holders of a spread key of `bits` bits are reused: `HOT_SPREAD_SECONDS`
    while its level has at most `SPREAD_KEYS_PER_REFRESH` keys, longer in proportion beyond, so
    that a reader of every key of a level makes as many lookups a second at any level (at most
    `HOT_SPREAD_MAX_SECONDS`)."""
    scale = max(1.0, 2**bits / SPREAD_KEYS_PER_REFRESH)
    return min(HOT_SPREAD_MAX_SECONDS, HOT_SPREAD_SECONDS * scale)


def owned_entries(entries: Mapping[str, Entry]) -> int:
    """Entries under a peer's own (signed) subkey: what a hot read is judged by. Open subkeys
    cost a writer nothing to add, so a replica could otherwise inflate our count and keep every
    later read on the full path."""
    return sum(owner_key(subkey) is not None for subkey in entries)


def direct_addrs(texts: Sequence[str]) -> list[Multiaddr]:
    """A contact's direct addresses. Relayed ones are learned from a peer's own signed records
    only: in a reply the replier names the contact, and could route our dials to anyone
    through a relay of its choosing (or to a backbone through itself, a dial that waits on
    itself). DHT servers are reachable inbound, so they need none."""
    return [addr for addr in map(_direct_addr, texts) if addr is not None]


@functools.lru_cache(maxsize=8192)
def _direct_addr(text: str) -> Multiaddr | None:
    """One text of `direct_addrs`, None where it does not parse or goes through a relay (as
    written or as parsed: `/unix/%2Fp2p-circuit` reads as one). Cached: replies name the same
    contacts over and over (`host._parse_addr`)."""
    parsed = parse_addrs([text])
    return parsed[0] if parsed and not is_circuit(parsed[0]) else None


def _outcome(error: RemoteError) -> str:
    if isinstance(error, DeadlineExceeded):
        return "timeout"
    return "unreachable" if isinstance(error, Unreachable) else "error"
