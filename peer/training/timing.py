"""Every duration the step protocol derives from the configuration and its measurements, in one
place (the trainer, the keeper, `peer doctor` and the tests read them here, nowhere else).

The one measurement is `store_seconds`, how long a DHT store of ours takes (a moving average):
on a high-latency link a ticket or a record needs longer to land, so the windows widen with it,
up to a cap that also bounds what a caller may ask of everyone else. The one fact of the
collaboration's size is `read_interval`: a large collaboration's records are read less often
than they are published (`peer.training.publisher.read_interval`), and every wait that counts
on a read counts on one every `reading` seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from peer.config import PeerConfig

STORES_PER_WINDOW = 4
"""A step we call gathers for at least this many of our DHT store times (measured)."""
MAX_WINDOW_FACTOR = 8
MAX_WINDOW_FLOOR = 30.0
"""The widest gathering window is `MAX_WINDOW_FACTOR` configured windows, at least this many
seconds (stores over the testbed's high-latency links took 4-5 s, so 20 s windows): also the
furthest ahead any call is believed (`latest_call`), so one peer's call cannot hold the others
for longer."""
SLOW_BATCH = 2.0
"""A micro-batch may run this many times its moving average (beside busy peers): a call leaves
the others time for one that slow, and a computing DeDLOC peer stops that early (at 100 M on
2 cores one ran past the declare margin, and its peer missed the step it had called)."""
MAX_DECLARE_MARGIN = 1.0
"""Seconds before a gathering closes that a peer stops computing, at most (`peer doctor` warns
about clock skew against it)."""


def publishing_interval(progress_interval: float, read_interval: float) -> float:
    """`Timing.publishing`: what `peer.training.publisher` waits between routine stores."""
    return max(progress_interval, read_interval / 2)


def exchange_deadline(progress_interval: float, rpc_timeout: float) -> float:
    """How long one progress exchange (our store, then a read) may take before it is cut
    (`peer.training.publisher`): an interval, and two calls' timeouts."""
    return max(progress_interval, 2 * rpc_timeout)


@dataclass(frozen=True, kw_only=True)
class Timing:
    gather_window: float
    progress_interval: float
    solo_after: float
    presence_ttl: float
    download_timeout: float
    rpc_timeout: float
    read_interval: float = 0.0
    """Seconds between two reads of the progress records (at least `progress_interval`)."""

    @classmethod
    def of(cls, config: PeerConfig) -> Timing:
        training = config.training
        return cls(
            gather_window=training.gather_window,
            progress_interval=training.progress_interval,
            solo_after=training.solo_after,
            presence_ttl=config.presence.ttl,
            download_timeout=config.state.download_timeout,
            rpc_timeout=config.net.rpc_timeout,
        )

    def reading_every(self, seconds: float) -> Timing:
        return dataclasses.replace(self, read_interval=seconds)

    @property
    def reading(self) -> float:
        """How old the records we act on may be: our reads' interval."""
        return max(self.progress_interval, self.read_interval)

    @property
    def publishing(self) -> float:
        """Seconds between two stores of a record that nothing urgent changed: the configured
        interval, or half the reads' interval where reads are stretched (nobody reads a
        collaboration that large more often; at 100 simulated peers the stores of records were
        a quarter of every node's DHT calls, to each of a shard's holders every second). The
        publisher also stores within a third of a record's life (`ProgressPublisher`)."""
        return publishing_interval(self.progress_interval, self.read_interval)

    @property
    def max_window(self) -> float:
        return max(MAX_WINDOW_FACTOR * self.gather_window, MAX_WINDOW_FLOOR)

    def window(
        self, store_seconds: float, batch_seconds: float = 0.0, read_seconds: float = 0.0
    ) -> float:
        """The gathering window of a step we call: `gather_window`, widened where our DHT
        stores are slow so that tickets still land before it closes, and where a micro-batch
        is long (`batch_seconds`, ours): our record with the call lands (a store), a peer
        reads it within a progress interval (a read: about a store's time), finishes the
        micro-batch it is in (`SLOW_BATCH` times ours), then declares before the margin.
        At most `max_window`. (At 100 M, 1 s micro-batches and a 2 s window: two peers of
        three missed a call. With internet round trips, 20-300 ms, stores take 0.5-1 s: in
        the simulation most peers missed 2-2.4 s windows, `simulation/`.) The read that shows
        the call takes a store's time, or `read_seconds` where ours take longer (reads of 100
        records took longer than a store: 100 simulated trainers logged "missed the
        gathering" 1,887 times in 5 minutes)."""
        seen_and_declared = (
            store_seconds
            + max(store_seconds, read_seconds)
            + self.reading
            + SLOW_BATCH * batch_seconds
            + self.declare_margin(store_seconds) / 2
        )
        return min(max(self._window(store_seconds), seen_and_declared), self.max_window)

    def _window(self, store_seconds: float) -> float:
        return min(max(self.gather_window, STORES_PER_WINDOW * store_seconds), self.max_window)

    def latest_call(self, now: float) -> float:
        """Calls gathering later than this are ignored: no honest caller asks for more than
        `max_window` (a read interval of slack for clocks and publication)."""
        return now + self.max_window + self.reading

    def declare_margin(self, store_seconds: float) -> float:
        """Our ticket must be in the DHT before the gathering closes: stop computing this early
        (at least twice what a store of ours takes)."""
        return max(min(self._window(store_seconds) / 4, MAX_DECLARE_MARGIN), 2 * store_seconds)

    def settle_patience(self, store_seconds: float) -> float:
        """How long a finished peer waits for the others to agree on its step and digest."""
        return 2 * self.window(store_seconds) + 4 * self.reading + 5

    @property
    def longest_read_interval(self) -> float:
        """Reads are at most this far apart, however large the collaboration: half the widest
        gathering window, which still holds a read, 1 s stores and a slow micro-batch
        (`SLOW_BATCH` times ours) where ours take up to ~6 s (at a quarter, ~9.75 s; but
        1,000 simulated trainers' reads all waited the cap there, not the byte budget)."""
        return self.max_window / 2

    @property
    def progress_ttl(self) -> float:
        """A trainer's progress record outlives three publications (and a presence record)."""
        return max(3 * self.progress_interval, self.presence_ttl)

    @property
    def keeper_interval(self) -> float:
        return max(self.progress_interval, 1.0)

    @property
    def keeper_ttl(self) -> float:
        return 3 * self.keeper_interval

    @property
    def first_read(self) -> float:
        """How long a starting trainer waits for its first read of the records."""
        return 2 * self.progress_interval + 5

    @property
    def projection_horizon(self) -> float:
        """How far a peer's count is projected past its record: about one publication, and
        the age of our read."""
        return self.publishing + self.reading

    @property
    def stale_record(self) -> float:
        """A record older than this looks silent (its peer may be gone): three publications,
        in a read up to `reading` old."""
        return 2 * self.publishing + self.reading

    @property
    def busy_record(self) -> float:
        """`stale_record` for a peer whose uplink is busy (averaging with us): each store of
        its record may wait out a whole exchange (`exchange_deadline`). The records of a 70.8 MB
        averaging's members were 3.1-5.0 s old where `stale_record` was 3 s, and 45 of 96
        members gave up on them and stalled the first step (100 simulated volunteers)."""
        return self.stale_record + exchange_deadline(self.progress_interval, self.rpc_timeout)

    def download_grace(self, store_seconds: float) -> float:
        """How long a caller holds a step for peers downloading it (`StepPolicy`): the read
        that shows them the certified step, a download, and their record's store, counted as
        one gathering window and a read (the window a call gives the others to join)."""
        return self.window(store_seconds) + self.reading

    def fallback_caller_wait(self, store_seconds: float) -> float:
        """How long a peer other than the designated caller waits before calling a step (the
        next lowest; the others a `fallback_turn` more per live peer below them)."""
        return self.progress_interval + self.reading + 4 * store_seconds

    def fallback_turn(self, store_seconds: float) -> float:
        """How long a call takes to be seen by the others: its record lands (a store), and a
        read up to `reading` old that takes about a store's time shows it."""
        return 2 * store_seconds + self.reading

    @property
    def rejoin_after(self) -> float:
        """Seconds without another participant in our reads before we join the DHT again
        (`StepPolicy.out_of_touch`): two gathering windows and two reads, so one slow read or
        a peer that stops between steps is no reason."""
        return 2 * self.gather_window + 2 * self.reading + self.progress_interval

    @property
    def solo_wait(self) -> float:
        """Seconds with nobody to average with before a peer may step alone (where
        `averaging.min_group_size` = 1 lets it)."""
        return self.solo_after
