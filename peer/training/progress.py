"""Training progress: each peer's signed record in the DHT, and what the collaboration's
records say when read together (pure).

Key `<collaboration>/progress` (split into shards by peer id once the collaboration is large:
`peer.training.shards`), subkey = the peer id, so only its owner can write an entry.
A record says where the peer is (the step of its state and a digest of its parameters), what it
has accumulated toward the next step, how fast, and, once it decides the collaboration has
enough samples, which step it *calls* and when that step's averaging starts (`gather_until`).

Every peer reads the same records and applies the same rules:
- no single record moves the collaboration: a (step, digest) counts only when at least `quorum`
  (`averaging.min_group_size`) distinct peers signed it (`peer.training.certificate`); the
  global step is the highest certified step (`global_step`), and only a certified state is
  ever downloaded;
- a step is called when the samples accumulated at it, projected over the gathering window,
  reach the target batch; the earliest `gather_until` among the calls for a step wins, so two
  peers that call at nearly the same moment still average together (a call gathering further
  ahead than the longest gathering window is ignored: it would hold every call); a peer stops computing
  once the samples it projects for the collaboration fill the batch, and says so (`holding`);
- the parameters of a step are those of the certified digest with the most signers at it (ties:
  the most holders, then the smallest digest), and a peer holding another digest downloads the
  state instead of training on;
- the target validation loss stops training on a peer's own validation, or on `quorum` peers'
  reports (`target_reached`), never on one other peer's word;
- a peer steps with its own samples alone only when nobody is left to average with
  (`company`), and a peer that says it is `downloading` is never counted as settled.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Annotated, Any, Literal

import msgspec

from peer.dht.records import owner_key
from peer.errors import DECODE_ERRORS
from peer.training.certificate import MAX_SIGNATURES, StepSignature, valid_signatures
from peer.training.steprule import MAX_ROUNDS, Candidate, Electorate, Vote

ProgressRole = Literal["trainer", "keeper"]
_Step = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
_History = Annotated[list[float], msgspec.Meta(max_length=16)]
_Digest = Annotated[str, msgspec.Meta(max_length=64)]
HISTORY = 8
"""How many past losses a record carries (the dashboard's trend)."""


class VoteRecord(msgspec.Struct, frozen=True, array_like=True):
    """A member's vote on a step (`peer.training.steprule`), as its record carries it: the
    record is its owner's signed DHT entry, so the vote is the owner's."""

    step: _Step
    average: _Digest
    """The candidate's digest (`Candidate.average`: its average's bits and weight)."""
    plan: _Digest
    plan_size: _Count
    electorate: _Digest
    """The electorate the vote is cast in (the step's, as the voter holds it)."""
    electorate_size: _Count
    round: Annotated[int, msgspec.Meta(ge=0, lt=MAX_ROUNDS)] = 0
    """The election's round (`Vote.round`)."""

    def vote(self, voter: str) -> Vote:
        candidate = Candidate(self.step, self.average, Electorate(self.plan, self.plan_size))
        electorate = Electorate(self.electorate, self.electorate_size)
        return Vote(voter, candidate, electorate, self.round)

    @classmethod
    def of(cls, vote: Vote) -> VoteRecord:
        candidate = vote.candidate
        return cls(
            candidate.step,
            candidate.average,
            candidate.plan.digest,
            candidate.plan.size,
            vote.electorate.digest,
            vote.electorate.size,
            vote.round,
        )


class ProgressRecord(msgspec.Struct, frozen=True):
    peer_id: Annotated[str, msgspec.Meta(max_length=128)]
    role: ProgressRole
    addrs: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=256)]], msgspec.Meta(max_length=16)
    ]
    step: _Step
    """Optimizer steps in this peer's state."""
    digest: Annotated[str, msgspec.Meta(max_length=64)]
    """Digest of the parameters at `step` (state.parameters_digest)."""
    samples: _Count
    """Samples accumulated toward step + 1."""
    samples_per_second: float
    updated_at: float
    loss: float | None = None
    """Recent training loss (moving average)."""
    validation_loss: float | None = None
    validation_step: _Step = 0
    call_step: int = -1
    """The step this peer has called (-1: none)."""
    gather_until: float = 0.0
    """Wall-clock time the called step's averaging starts."""
    recent_losses: _History = msgspec.field(default_factory=list)
    """Training loss when each of the last `HISTORY` steps was applied, oldest first."""
    recent_validation: _History = msgspec.field(default_factory=list)
    """The last `HISTORY` validation losses, oldest first (the newest is `validation_loss`)."""
    step_bytes: _Count = 0
    """Bytes this peer sent and received averaging its last step."""
    downloading: bool = False
    """Fetching another state: its step and digest are about to change."""
    holding: bool = False
    """Its part of the next step is done (dedloc: the collaboration has the target batch as it
    projects it; diloco: its inner steps): `samples` stays as it is until it averages."""
    signatures: Annotated[list[StepSignature], msgspec.Meta(max_length=MAX_SIGNATURES)] = (
        msgspec.field(default_factory=list)
    )
    """Signatures of (step, digest): its own and those of the peers it averaged with
    (`peer.training.certificate`); `decode_progress` keeps only the valid ones."""
    fingerprint: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """Its task's fingerprint (`layout.fingerprint`: task, mode, optimizer, shared tensors),
    also the averaging fingerprint: a backbone that aggregates joins the calls of the
    fingerprint stated by most trainers that hold the certified state, and a trainer trains
    only with records of its own fingerprint."""
    task: Annotated[str, msgspec.Meta(max_length=200)] = ""
    """What the fingerprint stands for, in words (shown when a joiner's task differs)."""
    reduced: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    """The fraction of the vector it reduced in its last averaging (its share as played, which
    `peer status` shows)."""
    vote: VoteRecord | None = None
    """Its vote on the step after `step` (`peer.training.steprule`), once it cast one: of the
    latest round it voted in."""
    earlier_votes: Annotated[list[VoteRecord], msgspec.Meta(max_length=MAX_ROUNDS - 1)] = (
        msgspec.field(default_factory=list)
    )
    """Its votes of the earlier rounds of that step's election, oldest first: a reader that
    saw only its latest would count it as unseen there (`StepRule.entry`)."""
    electorate: _Digest = ""
    """Who votes on the step after `step`: the plan of the candidate it holds as `step` (""
    where it does not know: step 0, or a state restored from a checkpoint)."""
    electorate_size: _Count = 0
    min_votes: Annotated[int, msgspec.Meta(ge=0, le=MAX_SIGNATURES)] = 0
    """The step rule it plays by (`StepRule.min_votes`: its `averaging.min_group_size`), so a
    viewer (`peer status`, the dashboard) counts steps by the collaboration's rule rather than
    its own config (`published_quorum`); 0: not stated."""
    leaving: bool = False
    """Its peer has left (its last record, in place of a withdrawal): counted for its vote and
    signatures only (`CollaborationView.farewells`), never as a trainer. Withdrawn, a vote
    cast just before leaving was lost, and a count it decided stalled."""

    def problem(self) -> str | None:
        """Why the record is unusable (non-finite numbers), or None."""
        numbers = [self.samples_per_second, self.updated_at, self.gather_until]
        numbers += [x for x in (self.loss, self.validation_loss) if x is not None]
        numbers += self.recent_losses + self.recent_validation
        if not all(math.isfinite(x) for x in numbers) or self.samples_per_second < 0:
            return "non-finite or negative figures"
        return None


def published_quorum(records: Iterable[ProgressRecord], fallback: int) -> int:
    """The signers a step needs as the collaboration's trainers state it (`min_votes`): the
    value most of them state, the larger on a tie (never one trainer's claim against the
    rest); `fallback` (the viewer's own config) where none states one."""
    stated = Counter(r.min_votes for r in records if r.role == "trainer" and r.min_votes > 0)
    if not stated:
        return fallback
    return max(stated.items(), key=lambda item: (item[1], item[0]))[0]


def progress_key(collaboration: str) -> str:
    return f"{collaboration}/progress"


def encode_progress(record: ProgressRecord) -> bytes:
    return msgspec.msgpack.encode(record)


#: Records of at most this many bytes are decoded once (ours are ~0.7 KB), at most
#: `DECODED_RECORDS` of them remembered: ~25 MB at most (measured in review), whatever
#: records strangers write.
DECODED_RECORD_BYTES = 4096
DECODED_RECORDS = 2048


def _decode(value: bytes | None) -> ProgressRecord | None:
    """A record's bytes decoded, None where they do not decode or hold non-finite figures."""
    if value is None:
        return None
    try:
        record = msgspec.msgpack.decode(value, type=ProgressRecord)
    except DECODE_ERRORS:
        return None
    return record if record.problem() is None else None


_decoded = lru_cache(maxsize=DECODED_RECORDS)(_decode)
"""`_decode` remembered by the bytes (records are frozen, and their lists never changed in
place): a peer that reads the same record again, or a simulation whose peers all read it,
decodes it once (300 simulated peers each read every record every ~1.6 s)."""


def _with_valid_signatures(record: ProgressRecord, collaboration: str) -> ProgressRecord:
    """`record` with only the step signatures that are valid for its (step, digest) in
    `collaboration` (itself where all of them are)."""
    valid = valid_signatures(record.signatures, collaboration, record.step, record.digest)
    if len(valid) == len(record.signatures):
        return record
    return msgspec.structs.replace(record, signatures=valid)


def _check(value: bytes, collaboration: str) -> ProgressRecord | None:
    record = _decoded(value)
    return None if record is None else _with_valid_signatures(record, collaboration)


_checked = lru_cache(maxsize=DECODED_RECORDS)(_check)
"""A small record's bytes decoded and its step signatures checked, remembered by the bytes
and the collaboration: a record carries up to `MAX_SIGNATURES` of them, the same ones read
after read, and a reader that took each through the signatures' own memo (a hash of each,
a sort) spent more on that than on the rest of the record (at 300 simulated peers, a tenth
of the simulator's time). Holds the same records as `_decoded` where every signature is
valid."""


def decode_progress(entries: dict[str, object], *, collaboration: str) -> list[ProgressRecord]:
    """Records from a progress get: only owner-signed entries naming their own subkey, each
    with only the step signatures that are valid for its (step, digest) in `collaboration`."""
    records = []
    for subkey, entry in entries.items():
        if owner_key(subkey) is None:
            continue
        value = entry.value  # type: ignore[attr-defined]
        if value is not None and len(value) <= DECODED_RECORD_BYTES:
            record = _checked(value, collaboration)
        else:
            record = _decode(value)
            if record is not None:
                record = _with_valid_signatures(record, collaboration)
        if record is not None and record.peer_id == subkey:
            records.append(record)
    return sorted(records, key=lambda r: r.peer_id)


@dataclass(frozen=True)
class CollaborationView:
    """The collaboration as one read of the progress records shows it."""

    records: list[ProgressRecord]
    """The records of the peers still here (`leaving` records move to `farewells`)."""
    quorum: int = 1
    """Distinct signers a (step, digest) needs to count (`averaging.min_group_size`)."""
    farewells: list[ProgressRecord] = field(default_factory=list)
    """The last records of peers that left: their votes and signatures still count."""

    def __post_init__(self) -> None:
        if any(r.leaving for r in self.records):
            object.__setattr__(
                self, "farewells", [*self.farewells, *(r for r in self.records if r.leaving)]
            )
            object.__setattr__(self, "records", [r for r in self.records if not r.leaving])

    def training(self, fingerprint: str) -> CollaborationView:
        """The records of the peers that train the task of `fingerprint`: the others never
        average with its peers, and their states do not fit its model. One view a
        fingerprint, so what it works out once (`global_step`, its signers) is not worked
        out again for the next asker: a trainer asks twice a read."""
        view = self._trainings.get(fingerprint)
        if view is None:
            view = self._trainings[fingerprint] = CollaborationView(
                [r for r in self.records if r.fingerprint == fingerprint],
                self.quorum,
                [r for r in self.farewells if r.fingerprint == fingerprint],
            )
        return view

    @cached_property
    def _trainings(self) -> dict[str, CollaborationView]:
        return {}

    def foreign_task(self, fingerprint: str) -> ProgressRecord | None:
        """A record of the task the collaboration trains when that is not the task of
        `fingerprint` (a peer started with another `--task`, model or mode): a task whose
        peers hold a certified step > 0 while ours hold none; the one at the highest step.
        Certified: a few records with another fingerprint (a newcomer's, a liar's) are not
        enough to turn anyone away."""
        if self.training(fingerprint).global_step > 0:
            return None
        found: tuple[int, ProgressRecord] | None = None
        for other in sorted({r.fingerprint for r in self.records} - {fingerprint, ""}):
            view = self.training(other)
            step = view.global_step
            holders = [r for r in view.records if r.step == step and r.task]
            if step > 0 and holders and (found is None or step > found[0]):
                found = step, holders[0]
        return None if found is None else found[1]

    @cached_property
    def _signers(self) -> dict[tuple[int, str], set[str]]:
        # Once per view: the trainer asks for the global step and consensus every iteration.
        return _signers_of([*self.records, *self.farewells])

    def _signers_without(self, peer_id: str) -> dict[tuple[int, str], set[str]]:
        """`_signers` of every record but `peer_id`'s, worked out once a view: each
        iteration of a trainer's loop views the last read with its own record as it is then
        (`with_record`), and at 1,000 simulated peers working out every record's signers
        again for that view took more of the simulator's time than any other function (8.7 %
        of py-spy's samples)."""
        found = self._without.get(peer_id)
        if found is None:
            found = self._without[peer_id] = _signers_of(
                [r for r in [*self.records, *self.farewells] if r.peer_id != peer_id]
            )
        return found

    @cached_property
    def _without(self) -> dict[str, dict[tuple[int, str], set[str]]]:
        return {}

    def signers(self, step: int, digest: str) -> set[str]:
        """Peers whose signatures of (step, digest) some record carries."""
        return self._signers.get((step, digest), set())

    def certified(self, step: int, digest: str) -> bool:
        """(step, digest) is the collaboration's: step 0 (every peer builds it from the task),
        or signed by `quorum` distinct peers."""
        return step == 0 or len(self.signers(step, digest)) >= self.quorum

    @property
    def global_step(self) -> int:
        """The highest certified step in view. A record claiming a higher step on its own
        moves nobody (it used to: every peer downloaded a lone liar's state)."""
        return max((r.step for r in self.records if self.certified(r.step, r.digest)), default=0)

    def trainers(self, step: int) -> list[ProgressRecord]:
        return self.kept(("trainers", step), lambda r: r.role == "trainer" and r.step == step)

    def kept(self, key: Hashable, keep: Callable[[ProgressRecord], bool]) -> list[ProgressRecord]:
        """The records `keep` keeps, in order; `key` names `keep` with every input it reads
        besides the record (the same key, the same test). Worked out once a read: a view of a
        read with one record replaced (`with_record`: a trainer's view at every turn of its
        loop) filters the read's other records once, then places the replaced one. At 1,000
        simulated peers each turn of each trainer walked every record several times."""
        origin = self.__dict__.get("_origin")
        if origin is None:
            found = self._kept.get(key)
            if found is None:
                found = self._kept[key] = [r for r in self.records if keep(r)]
            return list(found)
        read, record = origin
        others, ids = read._kept_without(record.peer_id, key, keep)
        if record.leaving or not keep(record):  # a leaving record is no record (farewells)
            return list(others)
        place = bisect.bisect_left(ids, record.peer_id)
        return [*others[:place], record, *others[place:]]

    def _kept_without(
        self, peer_id: str, key: Hashable, keep: Callable[[ProgressRecord], bool]
    ) -> tuple[list[ProgressRecord], list[str]]:
        """`kept` of every record but `peer_id`'s, with their ids: once a view."""
        found = self._kept.get((peer_id, key))
        if found is None:
            others = [r for r in self.records if r.peer_id != peer_id and keep(r)]
            found = self._kept[(peer_id, key)] = (others, [r.peer_id for r in others])
        return found

    @cached_property
    def _kept(self) -> dict[Hashable, Any]:
        return {}

    def catching_up(self, step: int) -> list[ProgressRecord]:
        """Trainers behind `step` (catching up, or gone and not yet expired) or downloading."""
        return [r for r in self.records if r.role == "trainer" and (r.step < step or r.downloading)]

    def settled(self, step: int, digest: str) -> bool:
        """Every trainer holds `step` with `digest` and none is downloading: nobody is left to
        catch up. (A peer mid-download still shows its old digest: two groups that averaged
        apart can swap digests, each fetching the other's, and a peer that left on seeing the
        old digests would end apart from them.)"""
        return all(
            r.step == step and r.digest == digest and not r.downloading
            for r in self.records
            if r.role == "trainer"
        )

    def samples(self, step: int) -> int:
        """Samples accumulated toward step + 1 by the peers at `step`."""
        return sum(r.samples for r in self.trainers(step))

    def throughput(self, step: int) -> float:
        return sum(r.samples_per_second for r in self.trainers(step))

    def computing_throughput(self, step: int) -> float:
        """Samples/s of the peers at `step` still computing toward step + 1 (not holding)."""
        return sum(r.samples_per_second for r in self.trainers(step) if not r.holding)

    def projected_samples(self, step: int, *, now: float, horizon: float) -> float:
        """Samples toward step + 1 by the peers at `step` as of `now`: each record's count plus
        its rate over the time since it was published (at most `horizon`: a silent peer is not
        projected on and on), except where the count is final (`holding`, `downloading`)."""
        total = 0.0
        for r in self.trainers(step):
            total += r.samples
            if not (r.holding or r.downloading):
                total += r.samples_per_second * min(max(0.0, now - r.updated_at), horizon)
        return total

    def eta(self, step: int, target_batch: int) -> float:
        """Seconds until the peers at `step` accumulate `target_batch` (inf when idle)."""
        missing = max(0, target_batch - self.samples(step))
        rate = self.throughput(step)
        return 0.0 if missing == 0 else (missing / rate if rate > 0 else math.inf)

    def call(
        self, step: int, *, after: float = -math.inf, latest: float = math.inf
    ) -> float | None:
        """When step's averaging starts, if anyone has called it: the earliest call wins.
        `after`: only calls gathering later than this (a peer that missed a gathering looks
        for the next call, not the one it missed). `latest`: calls gathering later than this
        are ignored (`Timing.latest_call`): one peer's call of the step days ahead would
        otherwise be the earliest forever and hold every other call."""
        times = [
            r.gather_until
            for r in self.records
            if r.call_step == step and after < r.gather_until <= latest
        ]
        return min(times) if times else None

    def consensus(self, step: int) -> str | None:
        """The digest of the parameters at `step`: among the certified ones, the one most
        peers signed (ties: most holders, then the smallest). None if none is certified."""
        holders = Counter(r.digest for r in self.records if r.step == step)
        certified = [digest for digest in holders if self.certified(step, digest)]
        if not certified:
            return None
        signers = {digest: len(self.signers(step, digest)) for digest in certified}
        return min(certified, key=lambda d: (-signers[d], -holders[d], d))

    def donors(self, step: int) -> list[ProgressRecord]:
        """Peers that hold the consensus state at `step`, keepers last."""
        digest = self.consensus(step)
        holders = [r for r in self.records if r.step == step and r.digest == digest]
        return sorted(holders, key=lambda r: (r.role == "keeper", r.peer_id))

    def votes(self, step: int) -> list[Vote]:
        """The votes on `step` the records carry (each record's are its owner's: one per
        round it voted in)."""
        return list(self._votes.get(step, ()))

    @cached_property
    def _votes(self) -> dict[int, list[Vote]]:
        # Once per view: an election asks for a step's votes several times an iteration.
        votes: dict[int, list[Vote]] = defaultdict(list)
        for r in [*self.records, *self.farewells]:
            if r.vote is not None:
                for v in [*r.earlier_votes, r.vote]:
                    votes[v.step].append(v.vote(r.peer_id))
        return votes

    def electorate(self, step: int, digest: str) -> Electorate | None:
        """Who votes on the step after `step`, as the holders of (`step`, `digest`) say: the
        plan most of them name, if it leads every other by `quorum` holders; None if none
        names one, or the lead is smaller. Every honest holder of a certified state names the
        same plan, the certified candidate's, so another is a liar's; a close count costs a
        downloader its first step (it counts nothing), where taking the most named let a
        few identities that padded a plan of their own to a tie with the honest holders (the
        smaller digest won ties) make it count their votes (review)."""
        named = Counter(
            Electorate(r.electorate, r.electorate_size)
            for r in [*self.records, *self.farewells]
            if r.step == step and r.digest == digest and r.electorate
        ).most_common()
        if not named:
            return None
        runner_up = named[1][1] if len(named) > 1 else 0
        first, count = named[0]
        return first if count - runner_up >= max(1, self.quorum) or runner_up == 0 else None

    def with_record(self, record: ProgressRecord) -> CollaborationView:
        """This view with `record` replacing its owner's (our own newest figures)."""
        found = self._place(record.peer_id)
        if found is None:
            others = [r for r in self.records if r.peer_id != record.peer_id]
            records = sorted([*others, record], key=lambda r: r.peer_id)
        else:  # the same list, spliced: a trainer views each read anew every iteration
            place, held = found
            records = [*self.records[:place], record, *self.records[place + held :]]
        farewells = [r for r in self.farewells if r.peer_id != record.peer_id]
        view = CollaborationView(records, self.quorum, farewells)
        signers = dict(self._signers_without(record.peer_id))  # its sets are never changed
        at = (record.step, record.digest)
        signers[at] = signers.get(at, set()) | {s.signer for s in record.signatures}
        view.__dict__["_signers"] = signers  # what `_signers` would work out, from the others'
        if self._sorted_ids is not None:  # records in peer id order, each peer's once: `kept`
            view.__dict__["_origin"] = (self, record)
        return view

    def record_of(self, peer_id: str) -> ProgressRecord | None:
        """`peer_id`'s record in this view (the first, in a view that is not a read's)."""
        found = self._place(peer_id)
        if found is None:
            return next((r for r in self.records if r.peer_id == peer_id), None)
        place, held = found
        return self.records[place] if held else None

    def _place(self, peer_id: str) -> tuple[int, bool] | None:
        """Where `peer_id`'s record is or would go in a read's records (peer ids ascending),
        and whether it is there; None in a view in another order."""
        ids = self._sorted_ids
        if ids is None:
            return None
        place = bisect.bisect_left(ids, peer_id)
        return place, place < len(ids) and ids[place] == peer_id

    @cached_property
    def _sorted_ids(self) -> list[str] | None:
        """The records' peer ids where they are in strictly ascending order (as a read's are:
        `decode_progress`), else None."""
        ids = [r.peer_id for r in self.records]
        return ids if all(a < b for a, b in itertools.pairwise(ids)) else None

    def target_reached(self, target: float) -> bool:
        """At least `quorum` distinct trainers report a validation loss at or below `target`
        (one peer's report alone ends nobody's training)."""
        reporters = {
            r.peer_id
            for r in self.records
            if r.role == "trainer" and r.validation_loss is not None and r.validation_loss <= target
        }
        return len(reporters) >= self.quorum

    def validation_loss(self) -> tuple[int, float] | None:
        """The newest validation loss any peer reported, with its step (what status shows)."""
        reported = [
            (r.validation_step, r.validation_loss)
            for r in self.records
            if r.validation_loss is not None
        ]
        return max(reported, key=lambda item: (item[0], -item[1])) if reported else None


def _signers_of(records: Iterable[ProgressRecord]) -> dict[tuple[int, str], set[str]]:
    """(step, digest) -> the peers whose signatures of it `records` carry."""
    signers: dict[tuple[int, str], set[str]] = defaultdict(set)
    for r in records:
        signers[(r.step, r.digest)].update(s.signer for s in r.signatures)
    return signers


@dataclass
class Moves:
    """When each trainer's step last changed (or it first appeared), as our reads saw it."""

    since: dict[str, tuple[int, float]] = field(default_factory=dict)

    def note(self, view: CollaborationView, now: float) -> None:
        """Update from a read at `now`; peers no longer in view are forgotten."""
        before = self.since
        self.since = {
            r.peer_id: before[r.peer_id]
            if r.peer_id in before and before[r.peer_id][0] == r.step
            else (r.step, now)
            for r in view.records
            if r.role == "trainer"
        }

    def moved_within(self, peer_id: str, seconds: float, now: float) -> bool:
        seen = self.since.get(peer_id)
        return seen is not None and now - seen[1] < seconds


def company(
    view: CollaborationView, step: int, me: str, moves: Moves, *, within: float, now: float
) -> list[ProgressRecord]:
    """The other trainers a step of ours taken with our samples alone would part from: those at
    `step` or beyond (they average at our step or hold a later one), and those behind that are
    catching up (their step moved, or they appeared, within `within` seconds: downloading our
    state, they are about to average with us). One stuck behind for longer holds nobody back."""
    return [
        r
        for r in view.records
        if r.role == "trainer"
        and r.peer_id != me
        and (r.step >= step or moves.moved_within(r.peer_id, within, now))
    ]


def should_call(
    view: CollaborationView,
    step: int,
    *,
    target_batch: int,
    window: float,
    now: float,
    horizon: float,
) -> bool:
    """DeDLOC: call `step` once its samples, projected to the end of the gathering window,
    reach the target batch (the window is spent computing; each peer then stops where the
    projection says the batch is full, `StepPolicy._batch_is_full`)."""
    projected = view.projected_samples(step, now=now, horizon=horizon)
    return projected + view.computing_throughput(step) * window >= target_batch
