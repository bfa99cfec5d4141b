"""The step protocol of one peer as a pure state machine (sans-IO, in the manner of h11).

`StepPolicy` remembers what the protocol needs (the state we hold and its signatures, our call,
the gatherings that failed for us, who moved when) and decides; `Trainer` executes what it
decides (torch work, DHT reads and stores, averaging, downloads). Its inputs: the collaboration
as the last read of the progress records shows it (`observe`), our local work (`Local`), what
came of an action (`declare`, `averaged`, `hold`, `fetched`) and the time of one injected
clock (`now`: wall-clock seconds, since calls gather at wall-clock times every peer compares).
Its output: the next action (`next_action`). No torch, no network, no sleeping.

Phases (`Phase`) and the events that move between them (`TRANSITIONS`, checked on every move):

    STARTING --read--> COMPUTING --full--> HOLDING
                       |  ^  ^   <--not full--'  |
                       |  |  |                   |
                       |  |  '--averaged--.      |        (declare in the background, dedloc
                       |  |               |      |         with delayed updates: the phase
                       +--|--declare--> AVERAGING <-declare   stays; `averaged` arrives later)
                       |  |
                       |  '--fetched-- CATCHING_UP <--behind-- (COMPUTING, HOLDING)
                       |
        (COMPUTING, HOLDING) --done--> SETTLING --settled--> STOPPED
                                       |  ^
                                       '--' behind / fetched (catching up before stopping)

One DeDLOC step, as `next_action` walks it every iteration:
  1. done (max_steps, our own validation or a quorum's under the target, left behind)? settle
  2. behind the certified global step, on a minority digest, or stranded ahead? catch up
  3. ready to be called (the batch is full as projected, or everyone holds) and we are the
     caller (the lowest peer id at our step, or a fallback after a wait)? call the step
  4. a call of our step near its gathering's close? declare (a fresh read first: an earlier
     call or a peer already past our step wins), then average
  5. our part done (our quota of the target batch; diloco: our H inner steps)? wait
  6. otherwise compute one micro-batch
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from peer.averaging.averager import AveragingResult, longest_averaging
from peer.config import PeerConfig
from peer.training.certificate import (
    MAX_SIGNATURES,
    StepSignature,
    carried,
    merge_signatures,
)
from peer.training.deal import deal
from peer.training.notary import CLAIM_SECONDS
from peer.training.progress import (
    CollaborationView,
    Moves,
    ProgressRecord,
    VoteRecord,
    company,
    should_call,
)
from peer.training.steprule import (
    ABSTAIN,
    MAX_ROUNDS,
    Candidate,
    Electorate,
    Entry,
    StepRule,
    Vote,
    abstention,
    plan_of,
)
from peer.training.timing import SLOW_BATCH, Timing

log = logging.getLogger("peertrain.trainer")

SLOW_CLAIM = 4.0
"""A peer's micro-batch counts for a call's window at most this many times the median's."""
#: Failed averagings in a row before the trainer logs a warning (fewer are routine, at INFO).
WARN_AFTER_FAILURES = 3
#: Longest wait between two failed state downloads (the wait doubles from progress_interval).
MAX_DOWNLOAD_BACKOFF = 30.0
#: Seconds at most that a peer holds its calls for others still in a failed averaging.
MAX_WAIT_FOR_OTHERS = 600.0
#: Share of the trainers at our step still in an earlier averaging from which we hold our
#: call for them (`_others_still_averaging`): below it, the rest are a two-thirds majority
#: that certifies the step without them, and they download it.
STILL_AVERAGING_SHARE = 1 / 3
#: Each read's weight against the slowest before it (`note_read_time`).
READ_DECAY = 0.8
#: Seconds: the gathering's close a call names is a multiple of this (`next_action`).
CALL_GRID = 1.0
#: Turns at most that a partial average defers its vote (`StepPolicy.elect`).
MAX_VOTE_TURNS = 3
#: Share of a plan's members whose votes a candidate needs before a deferred vote joins it
#: (`StepPolicy._cast`): fewer colluding members cannot draw it.
JOIN_SHARE = 1 / 3
#: Turns at most a fallback caller waits for the peers below it (`_may_call`): fresh records
#: with ground ids below ours delay our fallback call by no more than this many.
MAX_FALLBACK_TURNS = 8
#: Averagings in a row that read no ticket but ours, while others train, before we join the
#: DHT again (`out_of_touch`): our reads may have lost the replicas the others write to.
LONE_READS = 2


class Phase(enum.Enum):
    STARTING = "starting"
    """Before the first read of the progress records (are we behind?)."""
    COMPUTING = "training"
    """Micro-batches toward the next step."""
    HOLDING = "holding"
    """Our part of the next step is done: waiting for its call or its gathering."""
    AVERAGING = "averaging"
    """Our contribution is in an averaging (in the foreground)."""
    CATCHING_UP = "catching up"
    """Downloading a certified state."""
    SETTLING = "settling"
    """Done: waiting for the others to hold our step and digest (serving it meanwhile)."""
    STOPPED = "stopped"


class Event(enum.Enum):
    READ = "read"
    FULL = "full"
    NOT_FULL = "not full"
    DECLARE = "declare"
    DECLARE_IN_BACKGROUND = "declare in the background"
    AVERAGED = "averaged"
    BEHIND = "behind"
    FETCHED = "fetched"
    DONE = "done"
    SETTLED = "settled"


_TRAINING = {
    Event.DECLARE: Phase.AVERAGING,
    Event.DECLARE_IN_BACKGROUND: Phase.COMPUTING,  # its micro-batches are the next step's
    Event.AVERAGED: Phase.COMPUTING,  # a background averaging's result
    Event.BEHIND: Phase.CATCHING_UP,
    Event.DONE: Phase.SETTLING,
}
TRANSITIONS: dict[Phase, dict[Event, Phase]] = {
    Phase.STARTING: {Event.READ: Phase.COMPUTING},
    Phase.COMPUTING: {Event.FULL: Phase.HOLDING, **_TRAINING},
    Phase.HOLDING: {Event.NOT_FULL: Phase.COMPUTING, **_TRAINING},
    Phase.AVERAGING: {Event.AVERAGED: Phase.COMPUTING},
    Phase.CATCHING_UP: {Event.FETCHED: Phase.COMPUTING},
    Phase.SETTLING: {
        Event.BEHIND: Phase.SETTLING,
        Event.FETCHED: Phase.SETTLING,
        Event.SETTLED: Phase.STOPPED,
    },
    Phase.STOPPED: {},
}


class PhaseError(AssertionError):
    """The executor fed the policy an event its phase does not take (our bug, not a peer's)."""


# ------------------------------------------------------------------------------ inputs, actions


@dataclass(frozen=True, kw_only=True)
class Local:
    """Our local work as the executor sees it when it asks for the next action."""

    samples: int = 0
    """Samples of local work toward the next step, not yet taken for an averaging."""
    samples_per_second: float = 0.0
    batch_seconds: float = 0.0
    """How long one micro-batch takes (a moving average)."""
    averaging: bool = False
    """A delayed averaging of ours runs in the background (dedloc, delayed_updates)."""
    validation: tuple[int, float] | None = None
    """Our latest (step, validation loss)."""
    bandwidth: float | None = None
    """Our measured link, bytes/s (min of upload and download), if measured."""
    torn: bool = False
    """A download into our own tensors failed part-way: nothing to train on or offer until a
    download completes (`TorchWorker.torn`)."""


@dataclass(frozen=True)
class Compute:
    """One micro-batch of local work."""


@dataclass(frozen=True)
class Call:
    """We called the next step (our record now says so): publish it."""

    gather_until: float


@dataclass(frozen=True)
class Declare:
    """The gathering of our step closes soon: read the records once more (within `read_for`
    seconds), then `declare(gather_until)` and average if it says so."""

    gather_until: float
    read_for: float


@dataclass(frozen=True)
class CatchUp:
    """Download the certified state of `target` from `donors`, then `fetched(...)`. `within`:
    seconds the download may take (settling: what is left of its bound), None: its own."""

    donors: list[ProgressRecord]
    target: int
    within: float | None = None


@dataclass(frozen=True)
class Wait:
    """Nothing to do for up to `seconds`: until the records change (`for_averaging`: until our
    background averaging ends)."""

    seconds: float
    for_averaging: bool = False


@dataclass(frozen=True)
class Stop:
    """Training ends; `reason` is logged (empty: the ordinary end)."""

    reason: str = ""


Action = Compute | Call | Declare | CatchUp | Wait | Stop


@dataclass(frozen=True)
class Verdict:
    """What an averaging's result is: a step (apply `average`, or our own vector if `alone`)
    or not (our samples are kept for the next try)."""

    step: bool
    alone: bool = False
    global_batch: float | None = None
    """The samples behind the step (None: peers weighted equally, it counts peers)."""
    members: int = 0
    reason: str = ""
    """Why it is no step ("" when it is routine: nobody in our group had samples)."""
    failed_in_a_row: int = 0
    warn: bool = False
    """Failures persist: worth a warning."""


@dataclass
class Held:
    """The state we hold: its step, its digest and the signatures of it we know (ours first)."""

    step: int = 0
    digest: str = ""
    signatures: list[StepSignature] = field(default_factory=list)
    electorate: Electorate | None = None
    """Who votes on the next step (`steprule`): the plan of the candidate this state is. None:
    not known (step 0, a checkpoint's state)."""


class Outcome(enum.Enum):
    """Where the election of a candidate of ours stands (`StepPolicy.election`)."""

    WON = "won"
    """Our candidate is certified: apply it."""
    LOST = "lost"
    """Another candidate is certified: download it once its holders have it."""
    WAITING = "waiting"
    STALLED = "stalled"
    """Nothing certified for `StepPolicy.election_patience`: no step of ours; the next try of the
    step starts a new election (`_genesis_at`)."""


@dataclass
class Ballot:
    """The election of our candidate: the electorate we count it in, our vote (None: we are no
    member, or voted on the step already) and when it began."""

    candidate: Candidate
    electorate: Electorate
    genesis: bool
    vote: Vote | None
    since: float
    """When our vote was cast (or the election began, where we cast none)."""
    vote_at: float | None = None
    """A vote we defer until then (`elect`: a partial average waits for larger ones)."""
    gathering: float = math.nan
    """When the gathering our candidate came from closed (its call's `gather_until`)."""
    others_until: float = -math.inf
    """The averaging's outer deadline: no member averages past it."""


# ------------------------------------------------------------------------------ the policy


class StepPolicy:
    def __init__(self, *, me: str, config: PeerConfig, vector_size: int) -> None:
        self.me = me
        self.config = config
        self.training = config.training
        self.timing = Timing.of(config)
        self.vector_size = vector_size
        self.quorum = config.averaging.min_group_size
        """Distinct signers a (step, digest) needs before we download it or count it."""
        self.rule = StepRule(min_votes=self.quorum)
        self.ballot: Ballot | None = None
        """The election of our candidate, while it runs (`elect` .. `elected`)."""
        self.stall_count = ""
        """How the votes stood when our last election stalled (`election`), for the log."""
        self.last_vote: Vote | None = None
        """The last vote we cast: our record carries it until the next (slower readers count
        it after we moved on)."""
        # Our votes on a (step, electorate), one per round, oldest first.
        self._cast_votes: dict[tuple[int, Electorate], list[Vote]] = {}
        # The recent plans we were in, with their members: whose votes count in them.
        self._plans: dict[Electorate, frozenset[str]] = {}
        self._genesis_at = 0  # a step whose election stalled for us: its next try is a genesis
        self.notary = False
        """A genesis is applied only as the genesis notary registered it (`peer.training.notary`:
        the trainer sets it where it was given backbones). Without one, a genesis won in our
        view is applied, and views that differ can fork it (docs/SECURITY.md)."""
        self._notarized: dict[int, Candidate] = {}  # step -> the notary's registered genesis
        self._claim: Candidate | None = None  # a genesis certified in our view, to be notarized
        self._claim_at = -math.inf  # when we may ask the notary (again)
        # Until when the notary asked us to wait: the election stays open meanwhile.
        self._notary_wait_until = -math.inf
        # Trainers around our step in our recent reads -> when last seen (`_trainers_around`).
        self._around: dict[str, float] = {}
        self.phase = Phase.STARTING
        self.held = Held()
        self.view = CollaborationView([], self.quorum)
        """The last read of the progress records."""
        self.store_seconds = 0.0
        """How long a DHT store of ours takes (a moving average): windows widen with it."""
        self.read_seconds = 0.0
        """How long our reads of the records take (the slowest, decaying): a call's window
        widens with it (`Timing.window`)."""
        self.call: tuple[int, float] | None = None
        """(step, gather_until) of the call we made or are averaging in."""
        self.downloading = False
        self.highest_seen = 0
        self.changed = False
        """Our record changed in a way others act on: publish it now (`take_changed`)."""
        self._failed_before = -math.inf  # calls gathering at or before this failed for us
        self._failed_in_a_row = 0
        self._download_failures = 0  # in a row
        self._uncertified_since: float | None = None  # our state lacks a quorum since
        # When the others' steps last moved, and when someone to average with was last in
        # view: whether we may step alone (`_on_our_own`).
        self._moves = Moves()
        self._company_at: float | None = None
        # When our reads last showed another participant (None: before our first read), and
        # our averagings in a row that read no ticket but ours: `out_of_touch`.
        self._others_at: float | None = None
        self._lone_reads = 0
        self._ready_since: float | None = None  # when the step could first be called
        # (step, when) we first held our call for peers downloading our step (`_others_...`).
        self._downloads_held: tuple[int, float] | None = None
        # The step we know we have no candidate for (`abstain`), and when we last tried to
        # vote without one: the next try waits a vote turn.
        self._without_candidate = -1
        self._abstained_at = -math.inf
        self._dealt: tuple[object, int] | None = None  # (what our quota was dealt from, quota)
        self._settle_patience = math.inf
        self._settle_deadline = math.inf

    # -------------------------------------------------------------- events

    def _move(self, event: Event) -> None:
        try:
            self.phase = TRANSITIONS[self.phase][event]
        except KeyError:
            raise PhaseError(f"{event.value!r} in phase {self.phase.value!r}") from None

    def started(self) -> None:
        """The first read is in (or took too long): training begins."""
        self._move(Event.READ)

    def hold(
        self,
        step: int,
        digest: str,
        signature: StepSignature,
        *,
        electorate: Electorate | None = None,
    ) -> None:
        """We hold a new state (an applied step, a download, a checkpoint) and signed it.
        `electorate`: who votes on the next step, where known (an applied candidate's plan;
        a download's, as its holders name it)."""
        self.held = Held(step, digest, [signature], electorate)
        self._uncertified_since = None  # a new state: the next read starts its clock
        self.changed = True

    def note_store_time(self, seconds: float) -> None:
        """How long a DHT store of ours took (the progress loop times each one)."""
        first = self.store_seconds == 0.0
        self.store_seconds = seconds if first else 0.7 * self.store_seconds + 0.3 * seconds

    def note_read_time(self, seconds: float) -> None:
        """How long a read of the records took (the progress loop times each one)."""
        self.read_seconds = max(seconds, READ_DECAY * self.read_seconds)

    def observe(self, view: CollaborationView, now: float) -> None:
        """A read of the progress records."""
        self.view = view
        held = self.held
        # The others who hold our step and digest signed it too: carry their signatures, so
        # that our record certifies the state after they leave (decode checked them). Those
        # we carry already stay (their records may have left); new ones are published now.
        limit = carried(self.quorum)
        ours = {s.signer for s in held.signatures}
        theirs = [
            signature
            for r in (() if self._carries_all(view, ours, limit) else view.records)
            if r.peer_id != self.me and r.step == held.step and r.digest == held.digest
            for signature in r.signatures
        ]
        if theirs and held.signatures:
            merged = merge_signatures(
                held.signatures[0], [*held.signatures[1:], *theirs], limit=limit
            )
            if {s.signer for s in merged} != ours:
                held.signatures = merged
                self.changed = True
        signers = view.signers(held.step, held.digest) | {s.signer for s in held.signatures}
        if held.step == 0 or len(signers) >= self.quorum:
            self._uncertified_since = None
        elif self._uncertified_since is None:
            self._uncertified_since = now
        self.highest_seen = max(self.highest_seen, view.global_step)
        # Our own votes as our record (from before a restart) shows them: never a second
        # vote in a round they hold (review: a restarted peer forgot its votes).
        for vote in view.votes(held.step + 1):
            if vote.voter == self.me:
                self._carry_earlier_vote(vote.candidate.step, vote.electorate)
        if self._others_at is None or any(r.peer_id != self.me for r in view.records):
            self._others_at = now
        self._moves.note(view, now)
        if self._company(now):
            self._company_at = now
        # A peer this read shows is judged by its record now; one it does not show stays
        # counted for `rejoin_after` (a read can show part of the collaboration).
        recent = now - self.timing.rejoin_after
        self._around = {peer: seen for peer, seen in self._around.items() if seen >= recent}
        for r in [*view.records, *view.farewells]:
            self._around.pop(r.peer_id, None)
        for r in view.records:
            if r.role == "trainer" and abs(r.step - held.step) <= 1 and not r.downloading:
                self._around[r.peer_id] = now

    def _carries_all(self, view: CollaborationView, ours: set[str], limit: int) -> bool:
        """Whether our signatures (`ours`: their signers) are already what carrying the
        signatures in `view` would leave (`merge_signatures`: ours first, then the smallest
        signers, `limit` in all): no signer of our step in view is missing from them, or every
        missing one comes after our last (those are left out). Worked out from the view's
        signers, not its records: a read at 1,000 simulated peers walked every record's
        signatures, to find nothing new."""
        held = self.held
        if not held.signatures or len(held.signatures) > limit:
            return False
        others = ours - {held.signatures[0].signer}
        missing = view.signers(held.step, held.digest) - ours
        if len(others) < limit - 1:
            return not missing
        last = max(others, default="")
        return all(signer > last for signer in missing)

    def out_of_touch(self, now: float) -> bool:
        """We may have lost the others (a partition, contacts that died under our DHT calls):
        no other participant in our reads for `Timing.rejoin_after`, or `LONE_READS`
        averagings in a row that read no ticket but ours while other trainers are in view.
        The executor then joins the DHT again (`DHT.rejoin`) and calls `rejoined`."""
        if self._others_at is not None and now - self._others_at >= self.timing.rejoin_after:
            return True
        others = any(r.peer_id != self.me and r.role == "trainer" for r in self.view.records)
        return others and self._lone_reads >= LONE_READS

    def rejoined(self, now: float) -> None:
        """We joined the DHT again: the next `rejoin_after` counts from now."""
        self._others_at = now
        self._lone_reads = 0

    def take_changed(self) -> bool:
        changed, self.changed = self.changed, False
        return changed

    def declare(self, gather_until: float, now: float, *, in_background: bool) -> bool:
        """After the fresh read of a `Declare`: whether we average in the call gathering until
        `gather_until`. Not when a call of the step that gathers earlier wins (declaring in
        ours would leave us out of it), nor when a peer is already past our step (it took the
        step without us: we download instead, averaging it again would make a second
        version of the step)."""
        view = self.view
        earliest = self._current_call(view, now)
        if view.global_step > self.held.step or (earliest is not None and earliest < gather_until):
            return False
        self.call = (self.held.step, gather_until)  # our record shows the call we are in
        self.changed = True
        self._without_candidate = -1  # this gathering may give us one
        self._move(Event.DECLARE_IN_BACKGROUND if in_background else Event.DECLARE)
        return True

    def averaged(
        self, result: AveragingResult, samples: int, gather_until: float, now: float
    ) -> Verdict:
        """Whether an averaging's result is a step. Only an exact average is (`Averager`: of
        everyone in a planned round, of the members that took part in a single group): then
        every peer that steps applies the same bits."""
        self._move(Event.AVERAGED)
        self.call = None
        self._lone_reads = self._lone_reads + 1 if result.peers_seen == 1 else 0
        self.changed = True  # others wait for us to be done with this gathering
        # Alone only if nobody is left to average with: with others at our step or beyond,
        # our read of the tickets missed theirs (or we missed their gathering), and a step of
        # our own would part from theirs. A step of one peer certifies nothing
        # (`peer.training.certificate`): only where averaging.min_group_size = 1 says one is
        # enough.
        alone = (
            self.quorum <= 1
            and result.peers_seen == 1
            and not result.rounds
            and self._on_our_own(now)
        )
        complete = alone or result.average is not None
        # Peers that all had 0 samples average nothing: an optimizer step on that would still
        # move the weights (momentum, weight decay), so it is no step.
        contributed = samples > 0 if alone else result.weight > 0
        if complete and contributed:
            self._failed_in_a_row = 0
            # The average's total weight is the global batch, unless the peers were weighted
            # equally (diloco, outer_weighting = "uniform"): then it counts peers.
            batch = float(samples) if alone else None if self.uniform else result.weight
            # Not a step yet unless alone: a candidate, which the step rule elects or not
            # (`elect`, `election`).
            return Verdict(True, alone=alone, global_batch=batch, members=result.members or 1)
        self._failed_before = gather_until
        self.abstain(now)  # no candidate of ours: the others' rounds need not wait on us
        if complete:  # routine: e.g. peers that had just started or downloaded
            return Verdict(False)
        self._failed_in_a_row += 1
        in_a_row = self._failed_in_a_row
        # One failure is routine (a late ticket, a peer that just left) and the next try
        # heals it: a warning once failures persist, then every tenth one.
        warn = in_a_row >= WARN_AFTER_FAILURES and (in_a_row - WARN_AFTER_FAILURES) % 10 == 0
        reason = "; ".join(result.skipped) or (
            "we read no other ticket" if result.peers_seen == 1 else "a member failed"
        )
        return Verdict(False, reason=reason, failed_in_a_row=in_a_row, warn=warn)

    # -------------------------------------------------------------- the election

    def elect(
        self,
        candidate: Candidate,
        members: frozenset[str],
        now: float,
        *,
        basis: int | None = None,
        gathering: float = math.nan,
        others_until: float = -math.inf,
    ) -> None:
        """Our averaging ended on `candidate` (the next step's, if certified), whose plan
        `members` make and whose average holds `basis` of their contributions (None: all):
        vote if we are a member of the step's electorate and have not voted on the step yet,
        and count the votes from now on (`election`): `election_patience` after our vote, and
        while members of the plan are still in the averaging of the `gathering` (until its outer
        deadline, `others_until`, at most). A partial average (a member left
        mid-averaging) defers the vote by a turn per contribution it lacks (at most
        `MAX_VOTE_TURNS`), so that the larger averages of the gathering vote first and ours
        can join the leader (`_cast`): a departure split 62 peers 32 / 12 / 12 over three
        averages of one plan at 100 simulated peers, and none had a majority."""
        if plan_of(members) != candidate.plan:
            raise ValueError("the candidate's plan is not its members'")
        electorate, genesis = self.electorate_for(candidate)
        self._remember_plan(candidate.plan, members)
        self._without_candidate = -1  # we have one now: `_cast` votes it
        member = genesis or self.me in self._plans.get(electorate, ())
        self._carry_earlier_vote(candidate.step, electorate)
        self.ballot = Ballot(
            candidate,
            electorate,
            genesis,
            None,
            now,
            gathering=gathering,
            others_until=others_until,
        )
        # A member with a vote on the step already (an earlier gathering, a restart) moves on
        # to a next round only from `election`, a vote turn after its ballot began.
        voted = (candidate.step, electorate) in self._cast_votes
        if member and not voted and self._open_round(self.ballot) is not None:
            lacking = len(members) - (len(members) if basis is None else basis)
            if lacking > 0:
                self.ballot.vote_at = now + min(lacking, MAX_VOTE_TURNS) * self._vote_turn()
                # Our record shows the gathering's call until we vote, so members counting
                # meanwhile wait for our vote (`_members_averaging`): with neither a call nor
                # a vote in it, 34 of 40 simulated peers gave up on a 70.8 MB first step a few
                # seconds before the deferred votes that certified it came.
                if not math.isnan(gathering):
                    self.call = (candidate.step - 1, gathering)
            else:
                self._cast(now)
        self.changed = True

    def _carry_earlier_vote(self, step: int, electorate: Electorate) -> None:
        """A vote of ours the records still carry (we restarted since, and downloaded what we
        held): a second, for another candidate, would count one way for some readers and the
        other way for others. We carry the first instead (review); checked again when a
        deferred vote is cast, on the newer read (review)."""
        key = (step, electorate)
        earlier = sorted(
            (v for v in self.view.votes(step) if v.voter == self.me and v.electorate == electorate),
            key=lambda v: v.round,
        )
        if earlier and key not in self._cast_votes:
            self._cast_votes[key] = earlier
            self.last_vote = earlier[-1]

    def _vote_turn(self) -> float:
        """How long a vote takes to be seen by the others: it lands (a store), and a read up
        to `reading` old shows it (a store's time, or our reads' where slower)."""
        extra_read = max(0.0, self.read_seconds - self.store_seconds)
        return self.timing.fallback_turn(self.store_seconds) + extra_read

    def _cast(self, now: float) -> None:
        """Cast our deferred or immediate vote, or our vote in a next round, where a round is
        open to us (`_open_round`): for the candidate the rounds below force, else as we
        choose (`_free_choice`)."""
        ballot = self.ballot
        assert ballot is not None
        ours = ballot.candidate
        ballot.vote_at = None
        self._end_deferral(ballot)
        self._carry_earlier_vote(ours.step, ballot.electorate)
        opened = self._open_round(ballot)
        if opened is None:
            return  # we voted in every round open to us (our record carries it)
        round_, forced = opened
        votes = self._members_votes(ours.step, ballot.electorate)
        leader = self._last_round_leader(ours, ballot.electorate, round_, votes)
        choice = forced or leader or self._free_choice(ours, round_, votes)
        mine = self._cast_votes.get((ours.step, ballot.electorate), [])
        opened_by_others = any(v.round == round_ for v in votes)
        if (
            forced is None
            and leader is None
            and mine
            and mine[-1].candidate == choice
            and not opened_by_others
        ):
            # The vote we cast below, in a round nobody else has voted in, with no leader to
            # join: it would repeat the split that ended the round below, and spend a round
            # (a review: one member's candidate climbed all eight rounds alone, one a vote
            # turn). We wait for a leader, a retry's candidate, or others in the round (there
            # our vote settles it, as every member's must).
            return
        ballot.vote = self._record_vote(Vote(self.me, choice, ballot.electorate, round_))
        ballot.since = now

    def _record_vote(self, vote: Vote) -> Vote:
        """Our vote, cast: remembered (never a second in its round) and in our record."""
        self._cast_votes.setdefault((vote.candidate.step, vote.electorate), []).append(vote)
        # Forget only the votes of steps we hold: an election still running keeps its own
        # (forgotten, a member could vote again in a round it voted in: review).
        done = [key for key in self._cast_votes if key[0] <= self.held.step]
        for key in done[: max(0, len(self._cast_votes) - 8)]:
            del self._cast_votes[key]
        self.last_vote = vote
        self.changed = True
        return vote

    def abstain(self, now: float) -> None:
        """We have no candidate for the next step (our averaging of it failed, or we missed
        its gathering): as a member of its electorate, vote in the highest round open to us
        for the candidate the rounds below force, or, for our first vote on the step, an
        abstention (`steprule.abstention`) where members' votes for candidates in that round
        are `JOIN_SHARE` of the electorate: it lets a split round die rather than wait on us
        (39 of 95 members at 100 simulated peers had no candidate, and no round of the step
        could certify or die). Never a leader the rounds do not force (we cannot tell one a
        few members invented from a real one), nor a second abstention, nor one beside a few
        votes: each would spend a round (a review: one member's votes in rounds 0-7 drew the
        four without a candidate through all eight, and the retry that came had none left).
        Again every vote turn while we hold the step (`_follow_rounds`). Not while an
        election of ours runs (its ballot votes), nor in a first step's (a genesis)."""
        self._without_candidate = self.held.step + 1
        self._abstained_at = now
        electorate = self.held.electorate
        if self.ballot is not None or electorate is None:
            return
        step = self.held.step + 1
        self._carry_earlier_vote(step, electorate)  # a restart's vote is ours (review)
        opened = self._open_round_in(step, electorate)
        if opened is None:
            return
        round_, forced = opened
        choice = forced
        votes = self._members_votes(step, electorate)
        if choice is None and (step, electorate) in self._cast_votes:
            # We voted on the step already: only a candidate the rounds force, in the round
            # above the highest voted in (the members that back it there wait for ours).
            ours = votes + self._cast_votes[(step, electorate)]
            top = max(v.round for v in ours) + 1
            if top >= MAX_ROUNDS:
                return
            entry, forced = self.rule.entry(step, electorate, ours, top)
            if entry is not Entry.FORCED or forced is None:
                return
            round_, choice = top, forced
        if choice is None:
            members = {v.voter for v in votes if v.round == round_ and not v.candidate.abstains}
            if len(members) < JOIN_SHARE * electorate.size:
                return
            choice = abstention(step, electorate)
        self._record_vote(Vote(self.me, choice, electorate, round_))
        log.info(
            "no candidate of ours for step %d: voted %s in round %d",
            step,
            "an abstention" if choice.abstains else f"for {choice.average[:12]}",
            round_,
        )

    def _follow_rounds(self, local: Local, now: float) -> None:
        """Without a candidate for the next step (`abstain`), a vote turn after our last try:
        a round may be open to us now (others voted in it, or one forces a candidate).
        Unvoted there, the members without a candidate (a third of the electorate or more)
        would leave every round short of two thirds. Not while we are in a gathering of the
        step: it may give us a candidate (review: a background averaging's member abstained,
        then had nothing left to vote its average in)."""
        if (
            self._without_candidate == self.held.step + 1
            and self.call is None
            and not local.averaging
            and now >= self._abstained_at + self._vote_turn()
        ):
            self.abstain(now)

    def _free_choice(self, ours: Candidate, round_: int, votes: list[Vote]) -> Candidate:
        """Our vote in a round the rounds below leave free and no last round's leader claims
        (`_last_round_leader`, which `_cast` takes first: every member that reads it joins it,
        so the round certifies it), i.e. round 0: the candidate of our plan that members'
        votes in the round lead with, by more than ours would have with our vote and by at
        least `JOIN_SHARE` of the plan's members (a few colluding members cannot draw a
        deferred vote to a candidate they invented, which nobody could serve; in the rounds
        after a split they can, with a plurality: docs/SECURITY.md); else ours."""
        counts = Counter(
            v.candidate for v in votes if v.round == round_ and v.candidate.plan == ours.plan
        )
        if counts:
            leader, count = min(counts.items(), key=lambda item: (-item[1], item[0].average))
            enough = count >= JOIN_SHARE * ours.plan.size
            if leader != ours and count > counts[ours] + 1 and enough:
                return leader
        return ours

    def _last_round_leader(
        self, ours: Candidate, electorate: Electorate, round_: int, votes: list[Vote]
    ) -> Candidate | None:
        """The candidate that led the round before `round_` in our read, ours counted
        (`StepRule.lead`): one of our own plan's (the gathering we averaged in, whose members
        colluders must be), or another plan's only with `JOIN_SHARE` of the electorate behind
        it; else the leader among our plan's candidates. A few members that vote a candidate
        of a plan of their own cannot draw the electorate to it: certified, its plan would be
        the next step's electorate (review)."""
        step = ours.step
        cast = [*votes, *self._cast_votes.get((step, electorate), [])]
        leader = self.rule.lead(step, electorate, cast, round_)
        if leader is None or leader.plan == ours.plan:
            return leader
        backing = sum(1 for v in cast if v.round == round_ - 1 and v.candidate == leader)
        if backing >= JOIN_SHARE * electorate.size:
            return leader
        own_plan = [v for v in cast if v.candidate.plan == ours.plan]
        return self.rule.lead(step, electorate, own_plan, round_)

    def _members_votes(self, step: int, electorate: Electorate) -> list[Vote]:
        """The other members' votes on `step` in `electorate` that our last read shows."""
        members = self._plans.get(electorate, frozenset())
        return [
            v
            for v in self.view.votes(step)
            if v.voter != self.me and v.voter in members and v.electorate == electorate
        ]

    def _open_round(self, ballot: Ballot) -> tuple[int, Candidate | None] | None:
        """The round we may vote in now, and the candidate the rounds below force on us (None:
        free), or None: none open to us: the highest round above our last that
        `StepRule.entry` lets us enter: one the members' votes have reached, or the next after
        ours where the votes seen let ours end (it certifies nothing, or one candidate at
        most). Not simply the highest round voted in: one member's vote in round 7 held every
        other member's entry there for ever (review)."""
        return self._open_round_in(ballot.candidate.step, ballot.electorate)

    def _open_round_in(
        self, step: int, electorate: Electorate
    ) -> tuple[int, Candidate | None] | None:
        """`_open_round` in the rounds of `electorate`."""
        mine = self._cast_votes.get((step, electorate), [])
        if self.me not in self._plans.get(electorate, frozenset()):
            return None
        votes = self._members_votes(step, electorate) + mine
        last = mine[-1].round if mine else -1
        voted = {v.round for v in votes if v.round > last}
        for round_ in sorted((r for r in voted | {last + 1} if r < MAX_ROUNDS), reverse=True):
            entry, forced = self.rule.entry(step, electorate, votes, round_)
            if entry is Entry.WAIT:
                continue
            # Forced to the candidate we voted for in our last round, we stay there until
            # others vote in the next: climbing alone, members spread over the rounds (one a
            # vote turn) and none reached two thirds before they were spent (review).
            if forced is not None and mine and mine[-1].candidate == forced and round_ not in voted:
                continue
            return round_, forced
        return None

    def _end_deferral(self, ballot: Ballot) -> None:
        """Our record no longer shows the gathering's call that `elect` kept for a deferred
        vote."""
        if self.call == (ballot.candidate.step - 1, ballot.gathering):
            self.call = None
            self.changed = True

    def members_of_held(self) -> tuple[str, ...]:
        """The members of our state's electorate, where we know them (sorted; empty if not)."""
        electorate = self.held.electorate
        return tuple(sorted(self._plans.get(electorate, ()))) if electorate else ()

    def learn_members(self, members: Iterable[str]) -> bool:
        """A donor's claim of who votes on the step after the state we downloaded: taken if
        they make the electorate our state's holders name (the plan's digest is of its
        members), so we count the next step's votes as its members do. Whether taken."""
        electorate = self.held.electorate
        ids = frozenset(members)
        if electorate is None or not ids or plan_of(ids) != electorate:
            return False
        self._remember_plan(electorate, ids)
        return True

    def _remember_plan(self, plan: Electorate, members: frozenset[str]) -> None:
        self._plans.pop(plan, None)  # the most recent last: the oldest go first
        self._plans[plan] = members
        held = self.held.electorate  # kept: the next step's votes are counted in it (review)
        while len(self._plans) > 8:
            oldest = next(p for p in self._plans if p != held)
            del self._plans[oldest]

    def electorate_for(self, candidate: Candidate) -> tuple[Electorate, bool]:
        """The electorate of `candidate`'s step and whether it is a genesis (the candidate's
        own plan: the first step, a step whose election stalled for us, or one after a state
        of unknown plan that no holder names)."""
        held = self.held
        known = held.electorate or self.view.electorate(held.step, held.digest)
        if held.step == 0 or candidate.step <= self._genesis_at or known is None:
            return candidate.plan, True
        return known, False

    def election(self, now: float) -> tuple[Outcome, Candidate | None]:
        """The election of our candidate as our last read shows it: the certified candidate
        (ours: WON; another: LOST), or WAITING, or STALLED after `election_patience`. Casts
        our deferred vote first where its time has come (`_cast`; the caller publishes it:
        `take_changed`)."""
        ballot = self.ballot
        assert ballot is not None, "no election runs"
        if ballot.vote_at is not None and now >= ballot.vote_at:
            self._cast(now)
        pending = ballot.vote_at is not None  # the count may still decide without our vote
        step = ballot.candidate.step
        # Only members' votes: anyone can name an electorate (its digest and size are in every
        # holder's record), and a stranger's vote filled a missing member's place in the
        # count. An electorate whose members we do not know (a state we downloaded, not one
        # of our plans) we cannot count: no step of ours; we download the certified one at
        # once. Waiting out the count made a joiner miss the next gathering too, so it never
        # was in a plan that became an electorate, and never stepped (a real-process test).
        members = self._plans.get(ballot.electorate, frozenset())
        if not members:
            return Outcome.LOST, None
        member = ballot.genesis or self.me in members
        if member and not pending and now >= ballot.since + self._vote_turn():
            # A next round, where the votes let our last one end: a vote turn after our vote
            # or the ballot's start (the others' votes of our round come in meanwhile).
            self._cast(now)
        votes = [v for v in self.view.votes(step) if v.voter != self.me and v.voter in members]
        # Ours: this ballot's, or those we cast on the step before (a second gathering of it,
        # a restart), which our record carries and the others count.
        if member:  # a stranger's own vote is no member's (review: it won on 3 of 5)
            votes += self._cast_votes.get((step, ballot.electorate), [])
        if ballot.genesis:
            registered = self._notarized.get(step)
            certified = self.rule.genesis(step, ballot.electorate, votes)
            if certified is not None and not self._most_trainers_voted(certified, votes):
                certified = None
            if (
                registered is None
                and certified is None
                and 2 * ballot.electorate.size <= len(self._trainers_around())
            ):
                # Every member's vote would still be no majority of the trainers: waiting out
                # the patience only kept us out of the next gathering (100 simulated peers
                # gathered in alternating halves, each stalling while the other gathered).
                return self._stalled(votes), None
            if self.notary:  # the notary's registration, never our view's alone, decides
                self._claim = certified if registered is None else None
                certified = registered
        else:
            certified = self.rule.certify(step, ballot.electorate, votes)
        if certified == ballot.candidate:
            return Outcome.WON, certified
        # (We may have voted for another candidate of our plan: LOST, and we download it.)
        if certified is not None:
            return Outcome.LOST, certified
        if pending:
            return Outcome.WAITING, None
        if (
            now - ballot.since >= self.election_patience()
            and not self._members_averaging(now)
            and not self._waiting_for_notary(now)
        ):
            return self._stalled(votes), None
        return Outcome.WAITING, None

    def claim_due(self, now: float) -> tuple[Candidate, frozenset[str], str] | None:
        """A genesis our view certified (`election`) that the notary has not registered for us
        yet, its plan's members and the state it was made from (ours), where it is time to
        claim it (`peer.training.notary`)."""
        claim = self._claim
        if claim is None or now < self._claim_at or self.ballot is None:
            return None
        if self.held.step != claim.step - 1:
            return None  # we moved (a download): the claim is no longer ours to make
        return claim, self._plans.get(claim.plan, frozenset()), self.held.digest

    def notarized(self, answer: Candidate | float | None, now: float) -> None:
        """The notary's answer to our claim (`claim_due`): the step's registered genesis (ours
        or another: `election` then says WON or LOST), seconds to ask again in, or None (no
        answer, or a refusal: we ask again a vote turn on). Its wait has a floor (a second)
        and a cap (`CLAIM_SECONDS`). While the notary asks us to wait, the election stays
        open (`_waiting_for_notary`): a claim is renewed until it is decided, and its
        candidate is still ours to apply (review: a 10 s settle outlasted the patience, and
        the notary registered a candidate whose holders had given it up)."""
        if isinstance(answer, Candidate):
            self._notarized[answer.step] = answer
            for old in sorted(self._notarized)[:-8]:
                del self._notarized[old]
            self._claim, self._claim_at = None, -math.inf
            return
        wait = min(max(self._vote_turn() if answer is None else answer, 1.0), CLAIM_SECONDS)
        self._claim_at = now + wait
        if answer is not None:
            self._notary_wait_until = now + wait + self._vote_turn()

    def _waiting_for_notary(self, now: float) -> bool:
        """A claim of ours the notary is deciding (it asked us to wait, and we ask again by
        then): at most `CLAIM_SECONDS` past the patience, whatever it says."""
        ballot = self.ballot
        return (
            self._claim is not None
            and ballot is not None
            and now < self._notary_wait_until
            and now < ballot.since + self.election_patience() + CLAIM_SECONDS
        )

    @property
    def claim_at(self) -> float:
        """When a claim of ours is due (inf: none waits; `claim_due`)."""
        return self._claim_at if self._claim is not None else math.inf

    def _stalled(self, votes: list[Vote]) -> Outcome:
        """STALLED, with the count as we saw it (`stall_count`, for the log: why no step):
        the highest round anyone voted in (counted over every round, 98 members showed "-550
        unseen")."""
        ballot = self.ballot
        assert ballot is not None
        ours = [v for v in votes if v.electorate == ballot.electorate]
        last = max((v.round for v in ours), default=0)
        counts = Counter(v.candidate for v in ours if v.round == last).most_common()
        seen = sum(count for _, count in counts)
        abstained = sum(count for c, count in counts if c.abstains)
        split = " / ".join(str(count) for c, count in counts if not c.abstains) or "none"
        self.stall_count = (
            f"votes {split} of {ballot.electorate.size} members"
            + (f" in round {last}" if last else "")
            + ", "
            + (f"{abstained} abstained, " if abstained else "")
            + f"{ballot.electorate.size - seen} unseen"
        )
        if ballot.genesis:
            self.stall_count += f"; {len(self._trainers_around())} trainers around (a genesis)"
        return Outcome.STALLED

    def _members_averaging(self, now: float) -> bool:
        """Members of our candidate's plan whose records still show the call of its gathering:
        they are still averaging, and vote after it. Giving up on them at our patience, 18 of
        the 22 candidates of a 70.8 MB model's first step stalled (40 simulated volunteers;
        waiting, all 22 won). Until the averaging's outer deadline, and `MAX_WAIT_FOR_OTHERS`
        after our vote, at most: a record that claims it for ever (one member's claim) holds
        us no longer (review: up to 1,800 s where the patience is 16 s); a record older than
        a busy peer's (`Timing.busy_record`: its uplink carries the averaging's parts), or
        one with a vote on the step, not at all."""
        ballot = self.ballot
        assert ballot is not None
        if now >= min(ballot.others_until, ballot.since + MAX_WAIT_FOR_OTHERS):
            return False
        members = self._plans.get(ballot.candidate.plan, frozenset())
        step = ballot.candidate.step
        return any(
            r.peer_id in members
            and r.call_step == step - 1
            and r.gather_until == ballot.gathering
            and (r.vote is None or r.vote.step != step)  # one that voted is out of it
            and self._fresh(r, now, within=self.timing.busy_record)
            for r in self.view.records
            if r.peer_id != self.me
        )

    def election_patience(self) -> float:
        """How long after our vote an election may stay open: `settle_patience`, and the
        longest that a partial average of our plan defers its vote (`elect`). Shorter, the
        holders of the leading candidate gave up on it before the deferred votes certified
        it, and the peers that joined it had nobody to download it from (100 simulated
        peers: 55 downloads of step 1 that no holder served)."""
        return self.timing.settle_patience(self.store_seconds) + MAX_VOTE_TURNS * self._vote_turn()

    def _most_trainers_voted(self, certified: Candidate, votes: list[Vote]) -> bool:
        """A genesis plan's voters (for any of its candidates) are more than half of the
        trainers at the step (or one around it) in our recent reads (`_trainers_around`). A
        genesis has no electorate before it that its rivals share: two gatherings of the first
        step each certified their own at 100 simulated peers (a stray group beside the large
        one), and 131 peers then took the step as a second state. Two plans that each hold
        such a majority share a voter, who votes in the second only after the first stalled for
        it. The voters of the plan, not of the certified candidate: a departure split a plan's
        votes over several averages, and the leader's own votes could be no majority of the
        trainers (40 simulated peers, 70.8 MB: counting them, no step and 37 elections
        stalled; counting the plan's, 1 step).
        Within one read two genesis candidates never both win; reads that differ, or a peer
        counted in two genesis plans (it votes again after a stall), still could: where a
        notary is given, it decides among them (`claim_due`, `peer.training.notary`)."""
        voters = {v.voter for v in votes if v.electorate == certified.plan}
        return 2 * len(voters) > len(self._trainers_around() | voters)

    def _trainers_around(self) -> set[str]:
        """The trainers at our step or one around it, not downloading, as our last read shows
        them, and those it does not show that one of our reads of the last
        `Timing.rejoin_after` did (leavers out); and us. Not the last read's alone: a read can
        show part of the collaboration (a progress shard level some writers had left,
        `peer.training.shards`), and two such reads each let a minority win a genesis (100
        simulated peers took step 1 as two states)."""
        return set(self._around) | {self.me}

    def elected(self, outcome: Outcome) -> None:
        """The election ended (`election`'s outcome). STALLED: the step's next try votes in
        the rounds its electorate has open (`_open_round`); a genesis election among that
        try's plan only where the electorate is lost (`_electorate_lost`) or was a genesis's
        own, unless someone has moved past the step meanwhile (we download it then)."""
        ballot = self.ballot
        assert ballot is not None and outcome is not Outcome.WAITING
        self._end_deferral(ballot)
        self.ballot = None
        # A next try's genesis claims its own candidate, as soon as it is certified: not when
        # this claim was told to come back (up to `CLAIM_SECONDS` of the retry's election).
        self._claim, self._claim_at = None, -math.inf
        self._notary_wait_until = -math.inf
        self.changed = True
        # A stranger to the electorate (it cannot count) starts no genesis: members may still
        # certify the step, and it downloads the step then. Nor does a member of an
        # electorate that can still certify it: its next round does (two retry plans that
        # each won step 2 as a genesis took it as two states at 100 simulated peers).
        if (
            outcome is Outcome.STALLED
            and ballot.electorate in self._plans
            and (ballot.genesis or self._electorate_lost(ballot))
        ):
            self._genesis_at = max(self._genesis_at, ballot.candidate.step)

    def _electorate_lost(self, ballot: Ballot) -> bool:
        """Our ballot's electorate can no longer certify its step as far as we can tell: no
        more than two thirds of its members are in our recent reads (a round needs more).
        Then the step's next try is a genesis (the rule's stated assumption: members gone
        from our reads are gone). Not when its rounds are spent: a genesis of a plan with the
        electorate's very members is that electorate, its rounds spent too."""
        electorate = ballot.electorate
        here = {r.peer_id for r in self.view.records} | set(self._around) | {self.me}
        alive = len(self._plans.get(electorate, frozenset()) & here)
        return not self.rule.reaches(alive, electorate.size)

    def fetched(self, *, ok: bool, now: float) -> float:
        """A download ended (the new state came through `hold`); returns how long to wait
        before the next: 0 after a success, doubling from progress_interval after failures
        (busy or budget-limited donors refuse again if asked at once)."""
        self.downloading = False
        self.changed = True
        self._move(Event.FETCHED)
        if ok:
            self._download_failures = 0
            # Our digest changed: others may have changed theirs meanwhile (a swap).
            self._settle_patience = max(
                self._settle_patience, now + 4 * self.training.progress_interval
            )
            return 0.0
        self._download_failures += 1
        return min(
            self.training.progress_interval * 2 ** (self._download_failures - 1),
            MAX_DOWNLOAD_BACKOFF,
        )

    # -------------------------------------------------------------- the decision

    def next_action(self, local: Local, now: float) -> Action:
        if self.phase is Phase.SETTLING:
            return self._settling(local, now)
        if self.phase not in (Phase.COMPUTING, Phase.HOLDING):
            raise PhaseError(f"no action to take in phase {self.phase.value!r}")
        view = self.view_with(local, now)
        if self._done(local, now):
            self._move(Event.DONE)
            self.call = None  # the trainer cancels an averaging of ours: no call in our record
            self.changed = True  # ...which goes out at once (records are stored less often)
            self._settle_patience = now + self.timing.settle_patience(self.store_seconds)
            self._settle_deadline = self._settle_patience + self.timing.download_timeout
            if self.left_behind(now):
                log.warning(
                    "the collaboration finished at step %d and nobody holding that state is "
                    "left to download it from; stopping at step %d",
                    self.highest_seen,
                    self.held.step,
                )
            return self._settling(local, now)
        if not local.averaging and (donors := self.donors(view, now)):
            return self._catch_up(donors, view.global_step, None)
        self._follow_rounds(local, now)
        if local.torn:  # no state to compute on, call a step with or declare in
            return Wait(self.training.progress_interval)
        # With delayed updates too: the micro-batches computed while our averaging runs are our
        # part of the step after it, so they stop at our quota (before, they did not: 3 peers
        # applied 3,280 samples a step for a target of 64).
        full = self._batch_is_full(view, local, now)
        if full != self.holding:
            self._move(Event.FULL if full else Event.NOT_FULL)
            self.changed = True  # the others' projections take our count as final
            # Before the call's decision: with our record still computing, the iteration that
            # reached our quota projected our samples on, and called a step the others were
            # half-way through (a test that set the phase HOLDING by hand hid it).
            view = self.view_with(local, now)
        call = self._current_call(view, now)
        free = call is None and not local.averaging
        # Whether others would miss a call only once we could make one (its clocks start then).
        if (
            free
            and self._ready(view, local, now)
            and not self._waiting_for_others(view, local, now)
        ):
            if self._ready_since is None:  # the fallback caller's wait starts now
                self._ready_since = now
        else:
            self._ready_since = None
        window = self.timing.window(self.store_seconds)
        if self._may_call(view, local, now):
            # Long enough for the others to see the call and finish their micro-batch.
            ours = self.timing.window(
                self.store_seconds, self._call_batch_seconds(view, local, now), self.read_seconds
            )
            # On the grid: two calls made at nearly the same moment (peers whose views name
            # another lowest caller) are then one gathering, not two that split the step
            # (at 100 simulated peers, calls 24 and 18 strong, 0.1 s apart).
            call = math.ceil((now + ours) / CALL_GRID) * CALL_GRID
            if call > now + self.timing.max_window:  # others believe no call further ahead
                call = now + ours
            self.call = (self.held.step, call)
            self.changed = True
            log.info("calling step %d: averaging at +%.1fs", self.held.step + 1, ours)
            return Call(call)
        if call is not None and not local.averaging:
            margin = self.timing.declare_margin(self.store_seconds)
            if now > call - margin / 2:
                # Too late for our ticket to be seen: this step goes on without us, and we
                # catch up on the next (one that arrives mid-step waits for the next step).
                log.info("missed the gathering of step %d; joining the next", self.held.step + 1)
                self._failed_before = call
                self.abstain(now)
                call = None
            elif (full and now >= call - window / 2) or (
                self.training.mode == "dedloc"
                and now + SLOW_BATCH * local.batch_seconds >= call - margin
            ):
                # Our part is done, half the window is left (time for an earlier call of the
                # step to show: it wins, and a ticket in ours would pin us here), and our
                # ticket lands well before the close; or (dedloc) the gathering closes before
                # a slow micro-batch would end. A diloco peer averages only with exactly its
                # H inner steps.
                return Declare(call, read_for=margin / 4)
        if full:  # done: wait for the call, for its time to declare, or for our averaging
            wait = self.training.progress_interval / 2
            if local.averaging:
                return Wait(wait, for_averaging=True)
            if call is not None:
                wait = min(wait, max(0.0, call - window / 2 - now))
            return Wait(wait)
        return Compute()

    def _catch_up(self, donors: list[ProgressRecord], target: int, within: float | None) -> CatchUp:
        self._move(Event.BEHIND)
        self.downloading = True
        self.changed = True  # others must not take our old digest for settled
        return CatchUp(donors, target, within)

    def _settling(self, local: Local, now: float) -> Action:
        """Before stopping: stay (publishing progress, serving the state) until every trainer
        in view holds our step and digest, so that a peer that ended on another digest (a
        group that averaged apart) or a step behind catches up from us; we catch up likewise.
        Bounded: a silent peer's record may take a while to expire. While a trainer behind us
        or downloading is in view we stay longer, up to a state download's deadline: it would
        be left without a donor (a large state over a slow link takes minutes), or end on
        other parameters than ours."""
        left = self._settle_deadline - now
        if left <= 0:
            return self._stop(f"stopping at step {self.held.step} before every peer agreed")
        view = self.view_with(local, now)
        if donors := self.donors(view, now):
            return self._catch_up(donors, view.global_step, left)
        settled = view.settled(self.held.step, self.held.digest)
        if settled and self._stored_certificate() and self._others_certify(view):
            return self._stop("")
        if now > self._settle_patience and not view.catching_up(self.held.step):
            # Settled, our record not shown stored with the certificate (a store that failed):
            # everyone agreed all the same.
            early = f"stopping at step {self.held.step} before every peer agreed"
            return self._stop("" if settled else early)
        return Wait(min(self.training.progress_interval / 2, left))

    def _stored_certificate(self) -> bool:
        """Our record as the last read shows it (stored, not as we would publish it) certifies
        our step on its own. Settled peers withdraw their records as they stop: the last to
        go must leave one that carries the step's certificate, or a read in between sees the
        step uncertified (the churn test's status client read global step 0 after step 29)."""
        held = self.held
        if held.step == 0:
            return True
        ours = self.view.record_of(self.me)
        return (
            ours is not None
            and (ours.step, ours.digest) == (held.step, held.digest)
            and self._certifies_alone(ours)
        )

    def _certifies_alone(self, record: ProgressRecord) -> bool:
        """`record` carries its step's certificate on its own. A record carries at most
        MAX_SIGNATURES: a larger quorum needs several records."""
        return len({s.signer for s in record.signatures}) >= min(self.quorum, MAX_SIGNATURES)

    def _others_certify(self, view: CollaborationView) -> bool:
        """Every other trainer's record at our step carries the step's certificate on its own,
        as ours must (`_stored_certificate`). Whoever is last to leave leaves a certified record:
        three peers once withdrew within 40 ms of the step while a restarted one's record still
        carried only its own signature, and a status read saw global step 0 (the churn test)."""
        held = self.held
        if held.step == 0:  # every peer builds step 0 from the task: nothing to certify
            return True
        return all(
            self._certifies_alone(r)
            for r in view.trainers(held.step)
            if r.peer_id != self.me and r.digest == held.digest
        )

    def _stop(self, reason: str) -> Stop:
        self._move(Event.SETTLED)
        return Stop(reason)

    # -------------------------------------------------------------- what the records say

    @property
    def holding(self) -> bool:
        """Our part of the next step is done (what our record says: others' projections
        take our count as final), until its averaging ends."""
        return self.phase in (Phase.HOLDING, Phase.AVERAGING)

    @property
    def uniform(self) -> bool:
        """Peers weighted equally in the average (the DiLoCo paper's), not by samples."""
        return self.training.mode == "diloco" and self.training.outer_weighting == "uniform"

    def own_record(self, local: Local, now: float) -> ProgressRecord:
        """Our record as the protocol sees it (the executor adds addresses and figures)."""
        validation = local.validation
        if validation and not math.isfinite(validation[1]):
            validation = None  # others would drop the whole record (ProgressRecord.problem)
        call_step, gather_until = self.call or (-1, 0.0)
        return ProgressRecord(
            peer_id=self.me,
            role="trainer",
            addrs=[],
            step=self.held.step,
            digest=self.held.digest,
            samples=local.samples,
            samples_per_second=local.samples_per_second,
            updated_at=now,
            validation_loss=validation[1] if validation else None,
            validation_step=validation[0] if validation else 0,
            call_step=call_step,
            gather_until=gather_until,
            downloading=self.downloading,
            holding=self.holding,
            signatures=list(self.held.signatures),
            vote=None if self.last_vote is None else VoteRecord.of(self.last_vote),
            earlier_votes=self._earlier_votes(),
            electorate=self.held.electorate.digest if self.held.electorate else "",
            electorate_size=self.held.electorate.size if self.held.electorate else 0,
            min_votes=self.rule.min_votes,
        )

    def _earlier_votes(self) -> list[VoteRecord]:
        """Our votes in the earlier rounds of our last vote's election (our record carries
        them with it: `ProgressRecord.earlier_votes`)."""
        last = self.last_vote
        if last is None:
            return []
        cast = self._cast_votes.get((last.candidate.step, last.electorate), [])
        return [VoteRecord.of(v) for v in cast if v.round < last.round]

    def view_with(self, local: Local, now: float) -> CollaborationView:
        """The last read, with our own record as it is now."""
        return self.view.with_record(self.own_record(local, now))

    def donors(self, view: CollaborationView, now: float) -> list[ProgressRecord]:
        """Holders of the state to fetch when we are behind, hold a minority digest, or are
        stranded ahead (`stranded`), best first (`donor_order`)."""
        step = self.held.step
        target = view.global_step
        if target == step:
            consensus = view.consensus(step)
            if consensus is None or consensus == self.held.digest:
                return []
        elif target < step and not self.stranded(now):
            return []
        return donor_order([r for r in view.donors(target) if r.peer_id != self.me], self.me)

    def stranded(self, now: float) -> bool:
        """We applied a step that fewer than `quorum` peers signed (the others' averaging
        failed where ours completed: two peers under load, one stepped and one did not), and
        it stayed so for `Timing.settle_patience`. Nobody can download it and the others
        cannot average with us a step apart: we go back to the certified step they hold (a
        step nobody else holds is not the collaboration's), losing that step's samples."""
        since = self._uncertified_since
        patience = self.timing.settle_patience(self.store_seconds)
        return since is not None and self.held.step > 0 and now - since >= patience

    def _company(self, now: float) -> list[ProgressRecord]:
        return company(
            self.view, self.held.step, self.me, self._moves, within=self.timing.solo_wait, now=now
        )

    def _on_our_own(self, now: float) -> bool:
        """Nobody is left to average with (`progress.company`: no other trainer at our step or
        beyond, or behind and catching up), nor has been for `solo_after` seconds. Only then is
        a step of our samples alone no step apart from anyone's: sooner, a peer cut off from the
        others (or one whose clock made it miss their gathering) would run ahead alone, the
        others chasing it by download, and their work be dropped when the highest step wins
        after the heal; or it would end on parameters nobody else holds."""
        if self._company(now):
            return False
        since = self._company_at
        return since is None or now - since >= self.timing.solo_wait

    def left_behind(self, now: float) -> bool:
        """The collaboration reached max_steps without us, and its holders left: stepping on
        alone would end on parameters nobody else holds."""
        last = self.training.max_steps
        return bool(last) and self.held.step < last <= self.highest_seen and self._on_our_own(now)

    def _done(self, local: Local, now: float) -> bool:
        if self.training.max_steps and self.held.step >= self.training.max_steps:
            return True
        if self.left_behind(now):
            return True
        # Our own validation, or `quorum` peers' reports: one peer's word stops nobody.
        target = self.training.target_validation_loss
        own = local.validation
        return bool(target) and (
            (own is not None and own[1] <= target) or self.view.target_reached(target)
        )

    def _batch_is_full(self, view: CollaborationView, local: Local, now: float) -> bool:
        """Our part of the next step is done. diloco: our `inner_steps` (each peer takes
        exactly H). dedloc: our quota of the target batch (`quota`, dealt once a step:
        `_our_quota`), or the samples of the collaboration as we project them (ours exactly)
        are within half a micro-batch of the target, so one more would overshoot by more than
        it would fall short. The quotas bound the batch whatever the records' staleness; the
        projection stops us early where others did more than their quota."""
        micro_batch = self.config.task.micro_batch
        if self.training.mode == "diloco":
            return local.samples >= self.training.inner_steps * micro_batch
        if local.samples >= self._our_quota(view, local) * micro_batch:
            return True
        projected = view.projected_samples(
            self.held.step, now=now, horizon=self.timing.projection_horizon
        )
        return projected >= self.config.task.target_batch - micro_batch / 2

    def quota(self, view: CollaborationView, local: Local) -> int:
        """Our micro-batches of the next step: the target's micro-batches dealt out (`deal`)
        among the trainers about to take the step in proportion to their samples/s. Every peer
        with the same view deals the same way, so the quotas add up to the target (to a
        micro-batch: peers with other micro-batch sizes count in ours), however many peers:
        with more peers than micro-batches, each computes one in some of the steps."""
        return self._quota_of(self._dealing_rates(view, local), self._dealing_step(local))

    def _our_quota(self, view: CollaborationView, local: Local) -> int:
        """`quota`, dealt once a step, and again only when the trainers about to take it (or
        which of their rates are known) change, not on every read: the published rates move
        with each record (moving averages), and a peer that reached its quota computed again
        whenever a read dealt it one more, so a step applied the most each peer was dealt over
        its reads (3 peers applied 288 for 256, two of them dealt 3 for a moment each)."""
        rates = self._dealing_rates(view, local)
        step = self._dealing_step(local)
        key = (step, frozenset(rates), frozenset(peer for peer, rate in rates.items() if rate > 0))
        if self._dealt is None or self._dealt[0] != key:
            self._dealt = (key, self._quota_of(rates, step))
        return self._dealt[1]

    def _quota_of(self, rates: dict[str, float], step: int) -> int:
        units = max(1, round(self.config.task.target_batch / self.config.task.micro_batch))
        return deal(units, rates, step)[self.me]

    def _dealing_step(self, local: Local) -> int:
        """The deal our micro-batches are in (`deal` deals for the step after this one): ours,
        or while our averaging of the next step runs in the background (delayed updates, our
        micro-batches are the step after it) the next, as for the peers that applied it."""
        return self.held.step + int(local.averaging)

    def _dealing_rates(self, view: CollaborationView, local: Local) -> dict[str, float]:
        """The samples/s of the trainers about to take our next step (0: not known yet), as
        their records say. Ours as the others read it (our last stored record), not as it is
        now: with our fresh rate against their published ones, each peer of a warming-up
        collaboration took itself for the faster one and the quotas added up to more than the
        target."""
        rates = {r.peer_id: r.samples_per_second for r in self._step_company(view)}
        published = self.view.record_of(self.me)
        rates[self.me] = published.samples_per_second if published else local.samples_per_second
        return rates

    def _step_company(self, view: CollaborationView) -> list[ProgressRecord]:
        """The trainers about to take our next step with us, not downloading: at our step, or
        one behind that is a member of our step's plan or voted on our step (its record was
        published just before its step: it is still in our step's averaging or election). One
        behind that is neither missed our step and downloads it before it computes with us:
        counted, it held every call while its machine was paused (6 simulated volunteers, one
        paused for a minute at step 3: the other five, at step 4, waited it out)."""
        step = self.held.step
        electorate = self.held.electorate
        members = self._plans.get(electorate, frozenset()) if electorate else frozenset()

        def about_to_step(r: ProgressRecord) -> bool:
            # An abstention is no candidate: its voter downloads the step, as one that missed it.
            voted = r.vote is not None and r.vote.step == step and r.vote.average != ABSTAIN
            return r.step == step or (r.step == step - 1 and (r.peer_id in members or voted))

        return view.kept(
            ("step company", step, members),
            lambda r: r.role == "trainer" and not r.downloading and about_to_step(r),
        )

    def _current_call(self, view: CollaborationView, now: float) -> float | None:
        # Not the call we missed: with it still earliest in view, a peer that missed it would
        # call the step again on every iteration, and its calls would never take effect.
        return view.call(
            self.held.step, after=self._failed_before, latest=self.timing.latest_call(now)
        )

    def _ready(self, view: CollaborationView, local: Local, now: float) -> bool:
        """The step can be called: everyone about to take it holds (diloco: a barrier, each
        peer did its H steps; dedloc: or computes nothing), or (dedloc) the samples projected
        to the end of the gathering window reach the target (a caller done with its own part
        is not enough: the others would declare half-way through their quotas)."""
        step = self.held.step
        if self.training.mode == "diloco":
            return self._batch_is_full(view, local, now) and all(
                r.holding for r in view.trainers(step) if r.peer_id != self.me
            )
        # Nobody computes more: all hold, or compute nothing (a peer at 0 samples/s).
        done = all(
            r.holding or r.samples_per_second <= 0
            for r in self._step_company(view)
            if r.peer_id != self.me
        )
        return (done and self._batch_is_full(view, local, now)) or should_call(
            view,
            step,
            target_batch=self.config.task.target_batch,
            window=self.timing.window(self.store_seconds),
            now=now,
            horizon=self.timing.projection_horizon,
        )

    def _call_batch_seconds(self, view: CollaborationView, local: Local, now: float) -> float:
        """The micro-batch a call leaves the others time to finish: the 90th percentile of
        the computing trainers' at our step (by their fresh records' speed; ours as measured),
        not ours alone: a fast caller's windows left the slow peers of a simulated
        collaboration of volunteers out of its steps (`simulation/`). A claim counts for at
        most `SLOW_CLAIM` times the lower median (ours among two), so a record claiming a
        crawl widens no call past that, however few we are."""
        micro_batch = self.config.task.micro_batch
        claims = [
            micro_batch / r.samples_per_second
            for r in view.trainers(self.held.step)
            if r.peer_id != self.me
            and r.samples_per_second > 0
            and not (r.holding or r.downloading)
            and self._fresh(r, now)
        ]
        ceiling = SLOW_CLAIM * statistics.median_low([local.batch_seconds, *claims])
        seconds = sorted([local.batch_seconds, *(min(c, ceiling) for c in claims)])
        return seconds[min(len(seconds) - 1, int(0.9 * len(seconds)))]

    def _may_call(self, view: CollaborationView, local: Local, now: float) -> bool:
        """Whether we call the step now. One caller, so that two calls of a step made at
        nearly the same moment do not split it (each call's peers averaging apart, one part
        downloading the other's state: 8 peers in one process split 5-3 that way): the trainer
        at our step with the lowest peer id calls; another only if no call came for a while
        after it was ready (the lowest may be gone)."""
        if self._ready_since is None or self._waiting_for_others(view, local, now):
            return False
        peers = {r.peer_id: r for r in self._step_company(view)}
        lowest = min(peers, default=self.me)
        if self.me <= lowest:
            return True
        # Another calls only where the lowest looks silent: its record is stale, or it is done
        # and no call came; or, whatever its record says, after a long wait. The next lowest
        # first: each live peer between the lowest and us adds a turn (the time a call takes to
        # be seen), so a silent lowest gets one fallback call, not one from every peer waiting
        # (at 300 simulated peers, 36 called one step within 2 s; those that declared in a
        # later call than the others averaged apart and downloaded).
        waited = now - self._ready_since
        between = sum(
            1 for peer_id, r in peers.items() if lowest < peer_id < self.me and self._fresh(r, now)
        )
        fallback = self.timing.fallback_caller_wait(self.store_seconds) + min(
            between, MAX_FALLBACK_TURNS
        ) * self.timing.fallback_turn(self.store_seconds)
        record = peers[lowest]
        stale = not self._fresh(record, now)
        return waited >= fallback and (
            stale
            or record.holding
            or waited >= fallback + 4 * self.timing.window(self.store_seconds)
        )

    def _fresh(self, record: ProgressRecord, now: float, *, within: float | None = None) -> bool:
        """`record` was published recently enough that its peer looks alive (`within`
        seconds, `stale_record` unless given), and not later than that ahead of our clock: a
        record dated in the future (a peer's claim) would look alive for ever, while its entry
        lives."""
        limit = self.timing.stale_record if within is None else within
        return abs(now - record.updated_at) <= limit

    def _waiting_for_others(self, view: CollaborationView, local: Local, now: float) -> bool:
        """We hold our call for peers that would miss it: still in an averaging of our step,
        or downloading our step."""
        return self._others_still_averaging(view, local, now) or self._others_downloading(view, now)

    def _others_downloading(self, view: CollaborationView, now: float) -> bool:
        """Members of our step's electorate downloading our step (one behind, or at it on
        another digest) would miss a call made now: they declare only once they hold it, and
        a peer that misses a step downloads it again, while the next is called, and so on for
        ever (at 100 simulated peers, 30 of every gathering: each "missed the gathering" came
        right after a download of the step before). Wait for them, at most
        `Timing.download_grace` from the first time we were ready to call and did: a record
        that goes on saying it downloads, or a slow link, holds each step only that long. Only
        members (they averaged in the plan of the step we hold, so a stranger's record holds
        nothing: review), and only fresh records (a paused machine's goes stale)."""
        step = self.held.step
        electorate = self.held.electorate
        members = self._plans.get(electorate, frozenset()) if electorate else frozenset()
        downloading = any(
            r.role == "trainer"
            and r.peer_id != self.me
            and r.peer_id in members
            and r.downloading
            and r.step in (step - 1, step)
            and self._fresh(r, now)
            for r in view.records
        )
        if not downloading:
            return False
        if self._downloads_held is None or self._downloads_held[0] != step:
            self._downloads_held = (step, now)
        return now - self._downloads_held[1] < self.timing.download_grace(self.store_seconds)

    def _others_still_averaging(self, view: CollaborationView, local: Local, now: float) -> bool:
        """After an averaging that failed (or that we missed), others at our step may still be
        in it, waiting out a dead member: a call of ours now would close before they are free,
        they would miss it, and the step would split (each part stepping with fewer peers, the
        rest downloading). Wait until they are done (their record shows no call at or before
        it), at most as long as an averaging may take. Only while they are at least
        `STILL_AVERAGING_SHARE` of the trainers at our step: without them the rest cannot
        certify a step on their own, while a few stragglers are better left to download it (at
        100 simulated peers, 12 still in a failed averaging held 47 ready peers for 148 s)."""
        if self._failed_before == -math.inf:
            return False
        longest = self.longest_averaging(view, local)
        trainers = view.trainers(self.held.step)
        still = sum(
            1
            for r in trainers
            if r.peer_id != self.me
            and r.call_step == self.held.step
            and r.gather_until <= self._failed_before
            and now - r.gather_until < longest
        )
        return still > 0 and still >= STILL_AVERAGING_SHARE * len(trainers)

    def longest_averaging(self, view: CollaborationView, local: Local) -> float:
        """A bound on an averaging's length after its gathering (`longest_averaging`: its
        rounds' joins, waits and transfers of our vector at our measured bandwidth; at least
        the fixed bound it replaces, 30 s by default, which was shorter than one round of a
        400 MB vector at 50 MB/s). A failed one ends sooner: its members learn it at once.
        At most MAX_WAIT_FOR_OTHERS: a record that goes on claiming to be in the failed
        averaging holds every call only that long. A slower member's transfers are not in the
        bound (records carry no bandwidth): a call made while it is still in the averaging can
        go on without it (it then downloads the state)."""
        averaging = self.config.averaging
        bandwidth = (
            [max(averaging.min_bandwidth, local.bandwidth)] if local.bandwidth is not None else []
        )
        peers = len(view.trainers(self.held.step))
        floor = 4 * averaging.join_timeout + 2 * averaging.timeout_floor
        bound = longest_averaging(self.vector_size, peers, bandwidth, averaging)
        return min(MAX_WAIT_FOR_OTHERS, max(floor, bound))


def donor_order(donors: list[ProgressRecord], me: str) -> list[ProgressRecord]:
    """The order a download of ours asks `donors` in (it asks the first few, and the next as
    one fails: `StateDownload`): those that announce no relayed address first (reachable: a
    peer behind NAT announces one while it holds relay slots, and tensors never go through a
    relay, so it serves only where a punch works), keepers last (spared for those that find
    no other), each class in an order of our own (a hash of our id and theirs): in one
    order for everyone, every downloader would ask the same few donors first."""

    def rank(record: ProgressRecord) -> tuple[bool, bool, bytes]:
        relayed = any("/p2p-circuit" in addr for addr in record.addrs)
        mixed = hashlib.blake2b(f"{me}\n{record.peer_id}".encode(), digest_size=8).digest()
        return record.role == "keeper", relayed, mixed

    return sorted(donors, key=rank)
