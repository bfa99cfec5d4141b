"""The step rule (pure): which state is the collaboration's step, decided from votes.

An averaging for a step can end on several candidates: a member that leaves mid-averaging
narrows the bases of the groups it reaches (`peer.averaging.moshpit`), so the peers end on
different exact averages (at 100 simulated peers, one departure split 79 calls 32 / 24 / 18 / 4 /
1). The old rule let a candidate be a step only with a majority of the trainers in each peer's
own view: split like that, nobody stepped; and with views that differed, two candidates could
each be applied by their holders (the simulation's safety check caught it at step 1). This
rule certifies one candidate per step, however the votes are split, and never two.

Terms:
- the *electorate* of a step is the set of peers entitled to vote on it, named by a digest and
  its size. It is the plan of the gathering that produced the previous step's certified
  candidate (`Candidate.plan`: the Moshpit view every member of that plan shares), so every
  peer that holds the certified previous step agrees on it; the first step's electorate is its
  own plan (`genesis`);
- a *candidate* is one exact average of a step: the digest of its bits and the plan it came
  from;
- a *vote* is one member's choice of a candidate for the step, cast among the electorate it
  names, once per round of the step's election (below): its own candidate, the one the rounds
  force, or the leader of the round before (`StepRule.lead`).

**Rounds** (every step, the first included: `StepRule.certify`; `genesis` counts a first step
in its own plan): an election runs in numbered rounds within the step's one electorate, after
Fast Paxos (Lamport, 2006) with the member's record as its acceptor state:
- a member votes at most once per round, in rounds that only go up; its record carries its
  votes of every round of the step (`Vote.round`); a member seen with two votes in one round
  counts as unseen in every round (none of its votes count, and it voids nobody's count);
- a candidate is *certified in round r* by the votes of more than two thirds of the
  electorate in round r (`QUORUM`), and at least `min_votes`;
- a member *settled* round r if it voted in r or in a later round (it never votes in r after);
  the others are *unseen* in r. A member without a candidate for r (its averaging failed, it
  missed the gathering) votes an *abstention* (`abstention`): it settles r and counts for no
  candidate, so a round whose members failed to average can die rather than wait on them.
  A candidate is *possible* in round r (a reader's view) if its round-r votes plus the
  unseen could reach the quorum; any candidate is, if the unseen alone could (`Entry.WAIT`);
- a member enters round m (`StepRule.entry`) only as the highest round below m whose possible
  set is not empty allows: one possible candidate c: it must vote c (`FORCED`); two, or any
  unseen one: it waits (`WAIT`); none in any round below m: it votes as it likes (`FREE`), and
  the policy votes the leader of round m - 1 (`StepRule.lead`: the most votes, at least
  `min_votes`), so that members that read the same round vote alike.

**Safety** (property-tested with hypothesis in `tests/test_steprule.py`): for one step and
electorate, no two different candidates are ever certified, by any two readers, each from any
subset of the votes cast (partial reads, late votes, votes that never come), provided each
member votes at most once per round and readers agree on the electorate. Proof: if c is
certified in round r, c is possible in r for every reader (its final count is at most its
seen count plus the unseen), so whoever enters a round above r is forced to c or waits (by
induction, every vote in the rounds between is for c, so their possible sets hold c alone);
every later round certifies c or nothing; two certified rounds, each seen this way from the
lower one, certify one candidate. By induction on the step the electorates
agree (each is named by the unique certified candidate before it), so every peer that
applies a step applies the one certified candidate. A reader that sees more distinct voters
than the electorate has (strangers) certifies nothing for that step. An abstention is a vote
like any other (once per round, rounds that go up): the proof holds with it as a candidate
that is never certified nor possible.

**Liveness**: two thirds make a round decidable with members gone: two candidates are both
possible only while more than a third of the electorate is unseen, and a round dies (nothing
possible, the next is free) once its leader plus the unseen stays within two thirds. A round
split many ways by departures (the largest of 48 candidates held 19 of 205 votes, at 300
simulated peers: the old first-step rule, a plurality that must lead by more than the votes
unseen, waited for ever on 58 members without a vote) dies, and the next, where its voters
all vote its leader, certifies. Liveness needs more than two thirds of the electorate alive
to vote; an electorate that lost more (a small plan, a mass departure) is left by a genesis
among the trainers (`StepPolicy.elected`), the assumption below. Not yet: a farewell record
settles no round, so members that left stay unseen, and with more than a third of them gone a
round neither certifies nor dies (the genesis above leaves it).

What it assumes, and what happens otherwise (docs/SECURITY.md): the first step's electorate is
its own plan, and so is the next try of a step whose electorate lost more than a third of its
members, so two such plans with disjoint views could each certify one (300 simulated peers
did): a genesis is applied only as the genesis notary registered it (`peer.training.notary`:
one backbone, one candidate per step and parent state); identities are not scarce, so
`min_votes` identities that agree are an electorate of their own (Sybil).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from blake3 import blake3

QUORUM = (2, 3)
"""A round certifies a candidate with the votes of more than this share of the electorate."""
MAX_ROUNDS = 8
"""Rounds a step's election may take (a record carries a vote for each); past them it waits
for the electorate's departures to make a genesis (`StepPolicy.elected`)."""
ABSTAIN = ""
"""The average a member without a candidate votes for (`abstention`): it settles the round
for the member and counts for nothing."""


@dataclass(frozen=True, order=True)
class Electorate:
    """Who may vote on a step: a plan's members, by the plan's digest and their number."""

    digest: str
    size: int


@dataclass(frozen=True, order=True)
class Candidate:
    """One exact average of `step`: its bits' digest, and the plan it came from (the next
    step's electorate, if it is certified)."""

    step: int
    average: str
    plan: Electorate

    @property
    def abstains(self) -> bool:
        """No average: the vote of a member that has none to vote for (`abstention`)."""
        return self.average == ABSTAIN


def abstention(step: int, electorate: Electorate) -> Candidate:
    """What a member of `electorate` votes for in a round of `step` where it has no candidate
    and none is forced on it (its averaging failed, it missed the gathering): unvoted, it
    stays unseen, and with more than a third of such members a round neither certifies nor
    dies (100 simulated peers: "votes 56 of 95 members, 39 unseen", for good)."""
    return Candidate(step, ABSTAIN, electorate)


@dataclass(frozen=True)
class Vote:
    voter: str
    candidate: Candidate
    electorate: Electorate
    """The electorate the vote is cast in: the step's, as the voter holds it."""
    round: int = 0
    """The election's round (`StepRule.certify`)."""


class Entry(enum.Enum):
    """What the rounds below one allow a member entering it to vote (`StepRule.entry`)."""

    FREE = "free"
    FORCED = "forced"
    WAIT = "wait"


@dataclass(frozen=True)
class StepRule:
    """The collaboration's step rule, from its published parameters."""

    min_votes: int = 1
    """Votes a candidate needs at least, whatever the electorate's size
    (`averaging.min_group_size`: a step of one peer certifies nothing unless it says 1)."""

    def genesis(self, step: int, plan: Electorate, votes: Iterable[Vote]) -> Candidate | None:
        """A first step's certified candidate: its electorate is its own plan, and it is
        counted in rounds like every step after it (`certify`)."""
        found = self.certify(step, plan, votes)
        return found if found is not None and found.plan == plan else None

    def certify(self, step: int, electorate: Electorate, votes: Iterable[Vote]) -> Candidate | None:
        """The candidate some round of `step`'s election certifies from the votes seen: more
        than two thirds of `electorate` (and `min_votes`) voted for it in one round (module
        doc: no two rounds certify different candidates). None: none yet, or more voters than
        members (a member with two votes in a round is left out: `_ballots`)."""
        ballots = _ballots(step, electorate, votes)
        if ballots is None:
            return None
        for count in _rounds(ballots).values():
            for candidate, votes_for in count.items():
                if not candidate.abstains and self.reaches(votes_for, electorate.size):
                    return candidate
        return None

    def entry(
        self, step: int, electorate: Electorate, votes: Iterable[Vote], round: int
    ) -> tuple[Entry, Candidate | None]:
        """Whether a member may vote in `round` of `step`'s election, as the votes seen allow
        (module doc): (FREE, None), (FORCED, the candidate it must vote for), or (WAIT, None).
        The highest round below with a possible candidate decides."""
        ballots = _ballots(step, electorate, votes)
        if ballots is None:
            return Entry.WAIT, None
        rounds = _rounds(ballots)
        highest = [max(cast) for cast in ballots.values()]  # each voter's highest round
        n = electorate.size
        for below in range(round - 1, -1, -1):
            # Settled in `below`: voted in it or in a later round (it never votes in it again).
            unseen = n - sum(1 for r in highest if r >= below)
            possible = [
                c
                for c, votes_for in sorted(rounds.get(below, {}).items())
                if not c.abstains and self.reaches(votes_for + unseen, n)
            ]
            if self.reaches(unseen, n) or len(possible) > 1:
                return Entry.WAIT, None  # an unseen candidate, or either of two, could win it
            if possible:
                return Entry.FORCED, possible[0]
        return Entry.FREE, None

    def lead(
        self, step: int, electorate: Electorate, votes: Iterable[Vote], round: int
    ) -> Candidate | None:
        """The candidate a member votes for in `round` where the rounds below leave it free
        (`entry`): the one most members voted for in the round before (ties to the smaller
        digest), with `min_votes` at least; None in round 0, or where no candidate has them.
        Members that read the same round vote alike, so a round split many ways (a
        departure's partial averages: 48 candidates among 205 votes at 300 simulated peers)
        is followed by one that certifies; a member that reads part of it may choose another,
        and the round after forces the leader or chooses again. The most votes are the
        largest basis that members vouch for: each holds the average it votes for, or joined
        it in an earlier round."""
        if round == 0:
            return None
        ballots = _ballots(step, electorate, votes) or {}
        before = _rounds(ballots).get(round - 1, Counter())
        counted = [(c, n) for c, n in before.items() if not c.abstains and n >= self.min_votes]
        if not counted:
            return None
        leader, _ = min(counted, key=lambda item: (-item[1], item[0].average))
        return leader

    def reaches(self, votes: int, size: int) -> bool:
        """`votes` of an electorate of `size` certify in a round."""
        share, of = QUORUM
        return votes * of > share * size and votes >= self.min_votes


def _ballots(
    step: int, electorate: Electorate, votes: Iterable[Vote]
) -> dict[str, dict[int, Candidate]] | None:
    """Each counted voter's votes on `step` in `electorate`, by round; None where the count is
    not honest: more voters than members. A member with two votes in one round is left out
    (unseen in every round: no vote of its counts, and it settles no round): voiding the
    whole count let one member stall every step (review)."""
    ballots: dict[str, dict[int, Candidate]] = defaultdict(dict)
    liars: set[str] = set()
    for vote in votes:
        if vote.electorate != electorate or vote.candidate.step != step:
            continue
        if ballots[vote.voter].setdefault(vote.round, vote.candidate) != vote.candidate:
            liars.add(vote.voter)
    honest = {voter: cast for voter, cast in ballots.items() if voter not in liars}
    return honest if len(honest) <= electorate.size else None


def _rounds(ballots: dict[str, dict[int, Candidate]]) -> dict[int, Counter[Candidate]]:
    """Each round's count of the ballots' votes."""
    rounds: dict[int, Counter[Candidate]] = defaultdict(Counter)
    for cast in ballots.values():
        for round_, candidate in cast.items():
            rounds[round_][candidate] += 1
    return rounds


def plan_of(members: Iterable[str]) -> Electorate:
    """The electorate a plan's members make: a digest of their sorted peer ids, and their
    number. Every member of one Moshpit plan (or of one group) names the same."""
    ids = sorted(set(members))
    digest = hashlib.blake2b("\n".join(ids).encode(), digest_size=16).hexdigest()
    return Electorate(digest, len(ids))


def average_digest(values: np.ndarray, weight: float) -> str:
    """A candidate's digest: its average's bits and the weight behind it (BLAKE3, 4.9 GB/s
    on this machine class: 0.08 s for 100 M parameters; off the event loop all the same)."""
    hasher = blake3(struct.pack("<d", weight))
    hasher.update(np.ascontiguousarray(values).view(np.uint8).data)
    return hasher.hexdigest(length=16)
