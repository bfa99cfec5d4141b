"""The step rule (`peer.training.steprule`): one certified candidate per step, whatever
each reader sees of the votes, and a step certified on the largest basis when a member left
mid-averaging."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from peer.training.steprule import (
    MAX_ROUNDS,
    Candidate,
    Electorate,
    Entry,
    StepRule,
    Vote,
    abstention,
)


def candidates(step: int, count: int) -> list[Candidate]:
    return [
        Candidate(step, f"avg-{step}-{i}", Electorate(f"plan-{step}-{i}", 8)) for i in range(count)
    ]


@st.composite
def elections(draw: st.DrawFn) -> tuple[StepRule, Electorate, list[Vote], list[list[int]]]:
    """An electorate of n members, a few candidates, each member voting once for any of them
    or never (it left), and readers that each see any subset of the votes cast, in any
    order: partial reads, late votes, votes that never arrive."""
    n = draw(st.integers(1, 12))
    electorate = Electorate("e", n)
    options = candidates(1, draw(st.integers(1, 4)))
    choices = draw(st.lists(st.one_of(st.none(), st.sampled_from(options)), min_size=n, max_size=n))
    votes = [Vote(f"m{i}", c, electorate) for i, c in enumerate(choices) if c is not None]
    readers = draw(
        st.lists(st.lists(st.integers(0, max(0, len(votes) - 1)), unique=True), max_size=8)
    )
    rule = StepRule(min_votes=draw(st.integers(1, 3)))
    return rule, electorate, votes, readers


@settings(max_examples=2000, deadline=None)
@given(elections())
def test_in_one_round_no_two_readers_certify_two_candidates_and_each_certifies_the_final_count(
    election,
):
    rule, electorate, votes, readers = election
    final = rule.certify(1, electorate, votes)
    seen = set()
    for picks in [*readers, list(range(len(votes)))]:
        certified = rule.certify(1, electorate, [votes[i] for i in picks if i < len(votes)])
        if certified is not None:
            seen.add(certified)
            # What a reader applies is what everyone's complete count certifies.
            assert certified == final
    assert len(seen) <= 1


@st.composite
def chains(draw: st.DrawFn):
    """Three steps: each step's electorate is the plan of the candidate certified before it,
    the first step's its own plan (`plans[0]`: the first gathering's, which every member's view
    agrees on: the rule's stated assumption). Candidates come from any plan; members of every
    plan vote, so most votes are cast in an electorate that is not the step's."""
    plans = [Electorate(f"plan-{i}", draw(st.integers(1, 6))) for i in range(3)]
    votes = []
    for step in (1, 2, 3):
        options = [
            Candidate(step, f"avg-{step}-{i}", draw(st.sampled_from(plans))) for i in range(3)
        ]
        for electorate in plans:
            for member in range(electorate.size):
                choice = draw(st.one_of(st.none(), st.sampled_from(options)))
                if choice is not None:
                    votes.append(Vote(f"{electorate.digest}/m{member}", choice, electorate))
    masks = st.lists(st.booleans(), min_size=len(votes), max_size=len(votes))
    return plans, votes, draw(st.lists(masks, max_size=6))


def certified_chain(rule: StepRule, genesis: Electorate, votes: list[Vote]) -> list[Candidate]:
    """What a reader certifies step by step: the first step in its own plan (`genesis`), then
    each step in the electorate the step before names (`certify`)."""
    chain: list[Candidate] = []
    for step in (1, 2, 3):
        if step == 1:
            found = rule.genesis(1, genesis, votes)
        else:
            found = rule.certify(step, chain[-1].plan, votes)
        if found is None:
            break
        chain.append(found)
    return chain


@settings(max_examples=1000, deadline=None)
@given(chains())
def test_along_a_chain_every_reader_certifies_a_prefix_of_one_history(chain):
    plans, votes, readers = chain
    rule = StepRule()
    histories = [
        certified_chain(rule, plans[0], [v for v, keep in zip(votes, mask, strict=True) if keep])
        for mask in [*readers, [True] * len(votes)]
    ]
    longest = max(histories, key=len)
    for history in histories:
        assert history == longest[: len(history)]


def test_the_first_step_is_safe_only_where_its_gathering_s_views_agree():
    """The stated assumption, shown: two plans of a first step with disjoint views each
    certify their own candidate (the simulation's safety check counts it if it happens)."""
    rule = StepRule()
    one, other = Electorate("view-a", 2), Electorate("view-b", 2)
    a, b = Candidate(1, "avg-a", one), Candidate(1, "avg-b", other)
    votes = [Vote("m0", a, one), Vote("m1", a, one), Vote("m2", b, other), Vote("m3", b, other)]
    assert (rule.genesis(1, one, votes), rule.genesis(1, other, votes)) == (a, b)


def split_votes(electorate: Electorate, split: list[Candidate], sizes: list[int]) -> list[Vote]:
    """Round-0 votes of members m0, m1, ...: `sizes[i]` of them for `split[i]`."""
    basis = [c for c, n in zip(split, sizes, strict=True) for _ in range(n)]
    return [Vote(f"m{i}", c, electorate) for i, c in enumerate(basis)]


def test_a_member_that_left_mid_averaging_costs_the_groups_it_reached_not_the_step():
    # 80 members; one left; the rest ended on five exact averages of 32, 24, 18, 4 and 1.
    electorate = Electorate("e", 80)
    split = candidates(1, 5)
    votes = split_votes(electorate, split, [32, 24, 18, 4, 1])
    assert len(votes) == 79
    rule = StepRule(min_votes=2)
    # Members vote for their own basis: none has two thirds, nor can: round 0 dies.
    assert rule.genesis(1, electorate, votes) is None
    assert rule.entry(1, electorate, votes, 1) == (Entry.FREE, None)
    # Round 1: every member that read round 0 votes its leader, the largest basis.
    assert rule.lead(1, electorate, votes, 1) == split[0]
    votes += [Vote(f"m{i}", split[0], electorate, 1) for i in range(79)]
    assert rule.certify(1, electorate, votes) == split[0]
    # A quarter of round 0 read: its 60 unseen alone could reach two thirds: wait.
    assert rule.entry(1, electorate, votes[:79:4], 1) == (Entry.WAIT, None)


def test_a_first_step_split_48_ways_at_300_peers_certifies_in_the_next_round():
    """300 simulated peers (seed 0): 263 planned step 1, 205 voted for 48 candidates (the two
    largest 19 and 18 votes), 58 never voted. The first step's old count (the most votes, by
    more than the votes unseen) waited on the 58 for ever; in rounds, round 0 dies and round 1,
    where the 205 vote its leader, certifies it (more than two thirds: 176)."""
    plan = Electorate("p", 263)
    split = [Candidate(1, f"avg-{i}", plan) for i in range(48)]
    votes = split_votes(plan, split, [19, 18] + [4] * 30 + [3] * 16)
    assert len(votes) == 205
    rule = StepRule(min_votes=2)
    assert rule.genesis(1, plan, votes) is None
    assert rule.entry(1, plan, votes, 1) == (Entry.FREE, None)
    assert rule.lead(1, plan, votes, 1) == split[0]
    round_1 = [Vote(f"m{i}", split[0], plan, 1) for i in range(205)]
    assert rule.genesis(1, plan, votes + round_1[:175]) is None  # 175 is not above 2/3
    assert rule.genesis(1, plan, votes + round_1[:176]) == split[0]


@settings(max_examples=1000, deadline=None)
@given(st.data())
def test_a_round_read_in_full_by_its_members_certifies_the_next_whatever_its_split(data):
    """Liveness: any split of round 0 among any number of candidates and abstentions, with
    fewer than a third of the members unseen: the next round is open (never a wait), and if
    its voters all vote what `entry` forces or else `lead` picks, it certifies (where
    `min_votes` allows)."""
    draw = data.draw
    n = draw(st.integers(1, 40))
    electorate = Electorate("e", n)
    options = [*candidates(2, draw(st.integers(1, 12))), abstention(2, electorate)]
    voters = draw(st.integers(n - (n - 1) // 3, n))  # more than two thirds vote
    votes = [Vote(f"m{i}", draw(st.sampled_from(options)), electorate) for i in range(voters)]
    rule = StepRule(min_votes=draw(st.integers(1, 3)))
    if rule.certify(2, electorate, votes) is not None:
        return  # round 0 decided it
    entry, forced = rule.entry(2, electorate, votes, 1)
    assert entry is not Entry.WAIT
    choice = forced or rule.lead(2, electorate, votes, 1)
    if choice is None:
        return  # no candidate with min_votes votes: a retry's candidate must come
    votes += [Vote(f"m{i}", choice, electorate, 1) for i in range(voters)]
    assert rule.certify(2, electorate, votes) == choice


def test_with_every_vote_in_a_tie_goes_to_the_smaller_digest_in_the_next_round():
    electorate = Electorate("e", 4)
    a, b = candidates(1, 2)
    rule = StepRule()
    votes = [Vote("m0", a, electorate), Vote("m1", b, electorate), Vote("m2", b, electorate)]
    assert rule.entry(1, electorate, votes, 1) == (Entry.FORCED, b)  # with m3, b has 3 of 4
    votes.append(Vote("m3", a, electorate))
    assert rule.certify(1, electorate, votes) is None
    assert rule.entry(1, electorate, votes, 1) == (Entry.FREE, None)
    assert rule.lead(1, electorate, votes, 1) == min(a, b, key=lambda c: c.average)


def test_votes_of_another_step_or_electorate_count_for_nothing_and_a_double_voter_is_unseen():
    electorate = Electorate("e", 3)
    a, b = candidates(2, 2)
    rule = StepRule()
    stale = Electorate("old", 3)
    assert rule.certify(2, electorate, [Vote(f"m{i}", a, stale) for i in range(3)]) is None
    assert rule.certify(3, electorate, [Vote(f"m{i}", a, electorate) for i in range(3)]) is None
    votes = [Vote(f"m{i}", a, electorate) for i in range(3)]
    assert rule.certify(2, electorate, votes) == a
    assert rule.certify(2, electorate, [*votes, Vote("m0", b, electorate)]) is None  # 2 of 3
    strangers = [*votes, Vote("x", a, electorate)]
    assert rule.certify(2, electorate, strangers) is None


def test_a_candidate_needs_the_published_minimum_of_votes():
    electorate = Electorate("e", 1)
    (a,) = candidates(1, 1)
    alone = [Vote("m0", a, electorate)]
    assert StepRule(min_votes=1).certify(1, electorate, alone) == a
    assert StepRule(min_votes=2).certify(1, electorate, alone) is None
    pair = Electorate("p", 4)
    few = [Vote("m0", a, pair), Vote("m1", abstention(1, pair), pair)]
    assert StepRule(min_votes=1).lead(1, pair, few, 1) == a
    assert StepRule(min_votes=2).lead(1, pair, few, 1) is None  # nor leads a round


# ------------------------------------------------------------------ rounds in any order


def a_read(draw: st.DrawFn, cast: list[list[Vote]]) -> list[Vote]:
    """What one read shows: each member's record as of any moment, i.e. any prefix of the
    votes it cast (its newest record, an older one, or none at all)."""
    return [v for votes in cast for v in votes[: draw(st.integers(0, len(votes)))]]


@settings(max_examples=3000, deadline=None)
@given(st.data())
def test_rounds_never_certify_two_candidates_whatever_each_reader_sees(data):
    """Any interleaving: members vote in rounds that go up, each entering a round as its own
    read at that moment allows (`StepRule.entry`), or leave (they never act again); a read
    shows any prefix of each member's votes. At the end, over every vote ever cast (what any
    reader's count is a part of), no two candidates reach the quorum in any rounds."""
    draw = data.draw
    n = draw(st.integers(1, 7))
    electorate = Electorate("e", n)
    options = [*candidates(2, draw(st.integers(1, 3))), abstention(2, electorate)]
    rule = StepRule(min_votes=draw(st.integers(1, 2)))
    cast: list[list[Vote]] = [[] for _ in range(n)]
    for _ in range(draw(st.integers(1, 30))):
        member = draw(st.integers(0, n - 1))
        last = cast[member][-1].round if cast[member] else -1
        round_ = last + 1 + draw(st.integers(0, 1))  # mostly the next round, at times one more
        if round_ >= MAX_ROUNDS:
            continue
        # Its read shows its own votes in full, the others' as any read does.
        seen = [v for v in a_read(draw, cast) if v.voter != f"m{member}"] + cast[member]
        entry, forced = rule.entry(2, electorate, seen, round_)
        if entry is Entry.WAIT:
            continue
        choice = forced if entry is Entry.FORCED else draw(st.sampled_from(options))
        assert choice is not None
        cast[member].append(Vote(f"m{member}", choice, electorate, round_))
    rounds = Counter((v.round, v.candidate) for votes in cast for v in votes)
    winners = {
        c for (_, c), votes_for in rounds.items() if rule.reaches(votes_for, n) and not c.abstains
    }
    assert len(winners) <= 1
    certified = rule.certify(2, electorate, [v for votes in cast for v in votes])
    assert certified is None or not certified.abstains


def test_a_split_with_members_gone_dies_and_the_next_round_certifies_the_leader():
    """A departure split 93 members 45 / 40, 8 gone for good: neither reaches two thirds (62)
    nor can, so round 0 dies and round 1 is free; its voters join the leader and certify it.
    A count by the most votes, by more than the votes unseen, waited on the 8 for ever."""
    electorate = Electorate("e", 93)
    a, b = candidates(2, 2)
    votes = [Vote(f"m{i}", a if i < 45 else b, electorate) for i in range(85)]
    rule = StepRule(min_votes=2)
    assert rule.certify(2, electorate, votes) is None
    assert rule.entry(2, electorate, votes, 1) == (Entry.FREE, None)
    votes += [Vote(f"m{i}", a, electorate, 1) for i in range(62)]
    assert rule.certify(2, electorate, votes) is None  # 62 is not more than two thirds
    votes.append(Vote("m62", a, electorate, 1))
    assert rule.certify(2, electorate, votes) == a


def test_a_round_that_may_still_certify_forces_its_candidate_or_holds_the_next():
    electorate = Electorate("e", 9)
    a, b = candidates(2, 2)
    rule = StepRule()
    # 5 for a, 1 for b, 3 unseen: a could reach 8 of 9, b only 4: the next round must take a.
    votes = [Vote(f"m{i}", a, electorate) for i in range(5)] + [Vote("m5", b, electorate)]
    assert rule.entry(2, electorate, votes, 1) == (Entry.FORCED, a)
    # 3 for a, 3 for b, 3 unseen: either could reach 6 of 9 (not yet two thirds) ...
    even = [Vote(f"m{i}", a if i < 3 else b, electorate) for i in range(6)]
    assert rule.entry(2, electorate, even, 1) == (Entry.FREE, None)
    # ... 2 for a, 2 for b, 5 unseen: either could reach 7: the next round waits.
    assert rule.entry(2, electorate, even[1:3] + even[4:], 1) == (Entry.WAIT, None)
    # A later round's votes settle its voters in the rounds below: the 3 unseen voted in round
    # 1, so round 0 can no longer reach two thirds for b, nor for a past 8.
    later = votes + [Vote(f"m{i}", a, electorate, 1) for i in range(6, 9)]
    assert rule.entry(2, electorate, later, 2) == (Entry.FORCED, a)
    # A member with two votes in one round counts as unseen, and voids no count (review: one
    # member's second vote stalled every step): m0's are out, and 8 others certify a.
    double = [*later, Vote("m0", b, electorate)]
    assert rule.certify(2, electorate, double) is None  # 4 + 3 of round 0 and 1, no round 7
    double += [Vote(f"m{i}", a, electorate, 1) for i in range(1, 6)]
    assert rule.certify(2, electorate, double) == a  # round 1: 8 of 9, m0 not among them
    assert rule.certify(2, electorate, double[:-2]) is None  # 6 of 9: not more than 2/3


def test_members_without_a_candidate_abstain_and_the_round_dies_rather_than_waits():
    """100 simulated peers: "votes 56 of 95 members, 39 unseen", 30 / 26, for good: the 39
    had no candidate (they missed the gathering, or their averaging failed) and cast no vote,
    so either candidate could still reach two thirds and the next round waited. Abstaining,
    they settle round 0: it dies, round 1 is free, and its voters certify the leader. An
    abstention is never certified, nor forced, however many cast it."""
    electorate = Electorate("e", 95)
    a, b = candidates(2, 2)
    votes = [Vote(f"m{i}", a if i < 30 else b, electorate) for i in range(56)]
    rule = StepRule(min_votes=2)
    assert rule.entry(2, electorate, votes, 1) == (Entry.WAIT, None)
    none = abstention(2, electorate)
    votes += [Vote(f"m{i}", none, electorate) for i in range(56, 95)]
    assert rule.certify(2, electorate, votes) is None
    assert rule.entry(2, electorate, votes, 1) == (Entry.FREE, None)
    votes += [Vote(f"m{i}", a, electorate, 1) for i in range(64)]
    assert rule.certify(2, electorate, votes) == a
    # All abstain: nothing certified, and the next round is free, not forced to abstain.
    blank = [Vote(f"m{i}", none, electorate) for i in range(95)]
    assert rule.certify(2, electorate, blank) is None
    assert rule.entry(2, electorate, blank, 1) == (Entry.FREE, None)
    # Counted as a candidate, "" would win a tie on the smaller digest (review): it never
    # leads a round either.
    pair = Electorate("q", 2)
    tie = [Vote("m0", Candidate(1, "avg", pair), pair), Vote("m1", abstention(1, pair), pair)]
    assert StepRule(min_votes=1).lead(1, pair, tie, 1) == Candidate(1, "avg", pair)
