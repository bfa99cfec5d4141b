"""The step rule as the policy plays it (`StepPolicy.elect`, `election`, `elected`): votes in
the records, the electorate a held state names, genesis, once per step. Pure, on an explicit
clock; the rule's own safety property is in `tests/test_steprule.py`."""

from __future__ import annotations

import msgspec

from peer.averaging.averager import AveragingResult
from peer.training.policy import MAX_WAIT_FOR_OTHERS, Local, Outcome, StepPolicy
from peer.training.progress import CollaborationView, ProgressRecord, VoteRecord, encode_progress
from peer.training.steprule import Candidate, Electorate, Vote, abstention, plan_of
from tests.test_policy import ME, T0, make_policy, other, own_signature, read

MEMBERS = [ME, "z0", "z1", "z2", "z3"]
PLAN = plan_of(MEMBERS)  # the plan of step 3's candidate: who votes on step 4


def at_step_3(*, member: bool = True, me: str = ME) -> StepPolicy:
    """A policy of `me` holding step 3, a candidate of PLAN's (we were in that plan if
    `member`)."""
    policy = make_policy(me=me)
    if member:  # we averaged in step 3's plan (`elect` remembers its members)
        policy.elect(Candidate(3, "d3-average", PLAN), frozenset(MEMBERS), T0)
        policy.elected(Outcome.WON)
    policy.hold(3, "d3", own_signature(3), electorate=PLAN)
    return policy


MEMBERS_OF: dict[Candidate, frozenset[str]] = {}  # each test candidate's plan's members


def candidate(name: str, members: list[str], step: int = 4) -> Candidate:
    made = Candidate(step, name, plan_of(members))
    MEMBERS_OF[made] = frozenset(members)
    return made


def elect(policy: StepPolicy, choice: Candidate, now: float = T0) -> None:
    policy.elect(choice, MEMBERS_OF[choice], now)


def voting(peer_id: str, choice: Candidate, electorate: Electorate = PLAN) -> ProgressRecord:
    vote = VoteRecord.of(Vote(peer_id, choice, electorate))
    return other(peer_id, step=3, digest="d3", vote=vote)


def rounds(peer_id: str, *choices: Candidate) -> ProgressRecord:
    """A member's record with its votes of rounds 0, 1, ... (the latest as its vote)."""
    cast = [VoteRecord.of(Vote(peer_id, c, PLAN, i)) for i, c in enumerate(choices)]
    return other(peer_id, step=3, digest="d3", vote=cast[-1], earlier_votes=cast[:-1])


BIG = candidate("big", MEMBERS)
SMALL = candidate("small", [ME, "z0"])


def test_of_two_groups_that_averaged_a_step_apart_only_one_is_certified():
    """Before the rule, a group of a minority did not step (a majority of the trainers in
    view) and views differ, so both groups of a split could step (the simulation's safety
    check caught two states of one step). Now both elections see the same votes: 3 to 2 of
    5 is no two thirds, and nothing else can be, so round 0 ends and both vote in round 1
    for its leader, the larger; it wins, and the smaller group downloads it."""
    small, big = at_step_3(), at_step_3(me="z1")
    elect(small, SMALL, T0)
    elect(big, BIG, T0)
    records = [voting("z0", SMALL), voting("z2", BIG), voting("z3", BIG)]
    read(small, *records, voting("z1", BIG))
    read(big, *records, voting(ME, SMALL))
    later = T0 + small.election_patience()
    assert small.election(later) == big.election(later) == (Outcome.WAITING, None)
    assert small.last_vote == Vote(ME, BIG, PLAN, 1) and big.last_vote == Vote("z1", BIG, PLAN, 1)
    assert small.own_record(Local(), later).earlier_votes == [VoteRecord.of(Vote(ME, SMALL, PLAN))]
    records = [rounds("z0", SMALL, BIG), rounds("z2", BIG, BIG), voting("z3", BIG)]
    read(small, *records, rounds("z1", BIG, BIG))
    read(big, *records, rounds(ME, SMALL, BIG))
    assert small.election(later) == (Outcome.LOST, BIG)
    assert big.election(later) == (Outcome.WON, BIG)


def test_a_candidate_waits_while_unseen_votes_could_still_beat_it():
    """2 votes for ours, 1 against, 2 unseen: either could still reach 4 of 5 (two thirds)."""
    policy = at_step_3()
    elect(policy, BIG, T0)
    read(policy, voting("z0", BIG), voting("z1", SMALL))
    assert policy.election(T0 + 1) == (Outcome.WAITING, None)
    read(policy, voting("z0", BIG), voting("z1", SMALL), voting("z2", BIG))
    assert policy.election(T0 + 2) == (Outcome.WAITING, None)  # 3 of 5, 1 unseen
    read(policy, voting("z0", BIG), voting("z1", SMALL), voting("z2", BIG), voting("z3", BIG))
    assert policy.election(T0 + 3) == (Outcome.WON, BIG)  # 4 of 5


def test_a_departed_members_missing_vote_costs_a_round_not_the_step():
    """z3 left without voting. 3 for ours against 1: ours may still reach 4 of 5 in round 0,
    nothing else can, so round 1 takes ours (forced: the one who voted against moves first,
    then we join it); 2 against 2: nothing can reach 4, so
    round 1 is free, and takes round 0's leader (the smaller digest on a tie). Either way
    the 4 members left certify it in round 1. The old count waited for z3 on the 2 : 2, and the
    step's next try was a genesis: two such plans took step 2 as two states at 100 simulated
    peers."""
    for split, forced in (([BIG, BIG, SMALL], True), ([BIG, SMALL, SMALL], False)):
        policy = at_step_3()
        elect(policy, BIG, T0)
        records = [voting(f"z{i}", c) for i, c in enumerate(split)]
        read(policy, *records)
        assert policy.election(T0)[0] is Outcome.WAITING
        turn = T0 + policy._vote_turn()
        assert policy.election(turn) == (Outcome.WAITING, None)
        if forced:  # we backed the forced candidate: we stay until others vote in round 1
            assert policy.last_vote == Vote(ME, BIG, PLAN, 0)
            read(policy, *records[:2], rounds("z2", SMALL, BIG))
            assert policy.election(turn) == (Outcome.WAITING, None)
        assert policy.last_vote == Vote(ME, BIG, PLAN, 1), forced
        read(policy, *(rounds(f"z{i}", c, BIG) for i, c in enumerate(split)))
        assert policy.election(turn) == (Outcome.WON, BIG)


def test_a_stalled_step_is_a_genesis_only_where_its_electorate_is_lost():
    """An election that stalls (nothing certified in `election_patience`) leaves its next try
    in the rounds of the same electorate while more than two thirds of its members are in our
    reads; with z2 and z3 gone too (3 of 5 left: no round can reach 4), a genesis."""
    for here, genesis in ((["z0", "z1", "z2"], False), (["z0", "z1"], True)):
        policy = at_step_3()
        elect(policy, BIG, T0)
        # z0 and z1 voted in round 0 and hold: round 1 waits on the unseen.
        read(policy, voting("z0", SMALL), *(other(p, step=3, digest="d3") for p in here[1:]))
        patience = policy.election_patience()
        assert policy.election(T0 + patience - 0.1)[0] is Outcome.WAITING
        assert policy.election(T0 + patience)[0] is Outcome.STALLED
        policy.elected(Outcome.STALLED)
        retry = candidate("retry", MEMBERS[:4])
        elect(policy, retry, T0 + patience)
        ballot = policy.ballot
        assert ballot is not None and ballot.genesis is genesis, here
        assert ballot.electorate == (retry.plan if genesis else PLAN)


def test_an_election_stays_open_while_members_are_still_averaging():
    """A member whose averaging outlasts ours votes after it: giving up at our patience, 18
    of 22 candidates of a 70.8 MB model's first step stalled (40 simulated volunteers). Open
    while a member's fresh record still shows the gathering's call, up to the averaging's
    outer deadline (`AveragingResult.ends_by`) and MAX_WAIT_FOR_OTHERS after our vote."""
    gathering = T0 - 60.0

    def averaging(peer_id: str, at: float, **fields) -> ProgressRecord:
        fields = {"gather_until": gathering, **fields}
        return other(peer_id, step=3, digest="d3", call_step=3, updated_at=at, **fields)

    def electing(ends_by: float, *records: ProgressRecord, at: float) -> StepPolicy:
        # 1 vote for ours, 1 for another, 3 unseen: either could reach 4, no next round.
        policy = at_step_3()
        policy.elect(BIG, MEMBERS_OF[BIG], T0, gathering=gathering, others_until=ends_by)
        read(policy, voting("z0", SMALL), *records, now=at)
        return policy

    patience = at_step_3().election_patience()
    far = T0 + 10 * MAX_WAIT_FOR_OTHERS
    for at, outcome in ((T0 + patience, Outcome.WAITING), (T0 + MAX_WAIT_FOR_OTHERS - 1, Outcome.WAITING),
                        (T0 + MAX_WAIT_FOR_OTHERS, Outcome.STALLED)):  # fmt: skip
        policy = electing(far, averaging("z2", at), at=at)
        assert policy.election(at)[0] is outcome, at
    soon = T0 + 3 * patience  # the averaging's deadline: nobody averages past it
    assert electing(soon, averaging("z2", soon), at=soon).election(soon)[0] is Outcome.STALLED
    # A record past `stale_record` is a member whose uplink carries the averaging's parts
    # (70.8 MB: records 3.1-5.0 s old): waited for, up to `busy_record`.
    timing = at_step_3().timing
    late = T0 + patience
    busy = averaging("z2", late - timing.busy_record + 1)
    assert late - busy.updated_at > timing.stale_record
    assert electing(far, busy, at=late).election(late)[0] is Outcome.WAITING
    # A silent record, one with a vote on the step, one of another gathering: not waited for.
    stale_at = T0 + patience + timing.busy_record + 1
    assert electing(far, averaging("z2", T0), at=stale_at).election(stale_at)[0] is Outcome.STALLED
    now = T0 + patience
    assert electing(far, averaging("z2", now, gather_until=T0), at=now).election(now)[0] is (
        Outcome.STALLED
    )
    # z2 voted: round 0 can only go to its and z0's candidate, so we vote for it in round 1
    # (our patience starts again); z2 holds it open no longer.
    vote = VoteRecord.of(Vote("z2", SMALL, PLAN))
    policy = electing(far, averaging("z2", now, vote=vote), at=now)
    assert policy.election(now)[0] is Outcome.WAITING
    assert policy.last_vote == Vote(ME, SMALL, PLAN, 1)
    assert policy.election(now + patience)[0] is Outcome.STALLED


def test_a_member_votes_once_per_step_and_a_stranger_not_at_all():
    policy = at_step_3()
    elect(policy, BIG, T0)
    assert policy.ballot is not None and policy.ballot.vote == Vote(ME, BIG, PLAN)
    policy.elected(Outcome.LOST)
    elect(policy, candidate("again", MEMBERS), T0 + 1)  # a second gathering of step 4
    assert policy.ballot is not None and policy.ballot.vote is None
    assert policy.last_vote == Vote(ME, BIG, PLAN)  # our record still carries the first
    assert policy.own_record(Local(), T0).vote == VoteRecord.of(Vote(ME, BIG, PLAN))
    # "s" joined after step 3's gathering (it downloaded step 3): in step 4's plan, not in
    # step 3's, so it votes on step 5, not on step 4.
    stranger = at_step_3(member=False, me="s")
    joined = candidate("big", [*MEMBERS, "s"])
    elect(stranger, joined, T0)
    assert stranger.ballot is not None and stranger.ballot.vote is None
    # It does not know who step 3's plan's members are: it cannot tell their votes from a
    # stranger's, so it counts nothing and starts no genesis: at once no step of its own (it
    # downloads the step once the members certified it, and is a member of the next count).
    read(stranger, *(voting(p, joined) for p in MEMBERS[1:]))
    assert stranger.election(T0) == (Outcome.LOST, None)
    stranger.elected(Outcome.LOST)
    elect(stranger, candidate("again", [*MEMBERS, "s"]), T0 + 1)  # step 4's next try
    assert stranger.ballot is not None and not stranger.ballot.genesis
    stranger.hold(4, "d4", own_signature(4), electorate=joined.plan)  # it downloaded step 4
    assert stranger.members_of_held() == tuple(sorted(MEMBERS_OF[joined]))  # its plan's


def test_a_downloader_counts_the_next_step_among_the_members_its_donor_names():
    """ "s" downloaded step 3 and averaged in step 4's plan. It learns who votes on step 4
    from its donor's manifest, checked against the plan step 3's holders name: it counts
    step 4 as the members do, rather than losing its first step and downloading again. A
    donor's wrong list (a member left out, one added, another plan, none) is refused."""
    joined = candidate("joined", [*MEMBERS, "s"])

    def downloader() -> StepPolicy:
        return at_step_3(member=False, me="s")

    for claimed in (MEMBERS[:-1], [*MEMBERS, "s"], ["a", "b", "c", "d", "e"], []):
        refused = downloader()
        assert not refused.learn_members(claimed)
        elect(refused, joined)
        read(refused, *(voting(p, joined) for p in MEMBERS[1:]))
        assert refused.election(T0) == (Outcome.LOST, None)
    policy = downloader()
    assert policy.members_of_held() == ()
    assert policy.learn_members(reversed(MEMBERS))  # order does not matter
    assert policy.members_of_held() == tuple(sorted(MEMBERS))  # what it serves in turn
    elect(policy, joined)
    assert policy.ballot is not None and policy.ballot.vote is None  # no member of step 3's
    read(policy, *(voting(p, joined) for p in MEMBERS[1:]))
    assert policy.election(T0) == (Outcome.WON, joined)


def test_a_member_that_restarted_carries_the_vote_its_record_still_shows():
    """Review: a member that voted on step 4, restarted (its memory of the vote gone) and
    downloaded step 3 learns it is a member of step 4's electorate. A second vote, for another
    candidate, would count one way for readers of its old record and the other way for the
    rest; it carries the first, and counts it."""
    policy = at_step_3(member=False)
    assert policy.learn_members(MEMBERS)
    first = candidate("first", MEMBERS)
    ours_before = other(ME, step=3, digest="d3", vote=VoteRecord.of(Vote(ME, first, PLAN)))
    read(policy, ours_before, voting("z0", first), voting("z1", first))
    elect(policy, BIG)  # another candidate of step 4, after the restart
    assert policy.last_vote == Vote(ME, first, PLAN)
    assert policy.own_record(Local(), T0).vote == VoteRecord.of(Vote(ME, first, PLAN))
    read(policy, voting("z0", first), voting("z1", first), voting("z2", first))
    assert policy.election(T0) == (Outcome.LOST, first)  # 4 of 5, ours counted


def test_a_strangers_vote_does_not_fill_a_missing_members_place():
    """Review: anyone can name an electorate (its digest and size are in every holder's
    record). z3 left without voting, A and B have 2 votes each; a stranger's vote for A made
    it 3 to 2 with nobody unseen, and it could switch to B for another reader: a fork."""
    policy = at_step_3()
    elect(policy, BIG)
    members = [voting("z0", BIG), voting("z1", SMALL), voting("z2", SMALL)]
    read(policy, *members, voting("zz-stranger", BIG))
    assert policy.election(T0)[0] is Outcome.WAITING  # 2 : 2 with z3 unseen


def test_votes_cast_in_another_electorate_or_for_another_step_do_not_count():
    policy = at_step_3()
    elect(policy, BIG, T0)
    elsewhere = plan_of(["a", "b", "c", "d", "e"])
    read(
        policy,
        *(voting(p, SMALL, electorate=elsewhere) for p in MEMBERS[1:]),
        voting("z9", candidate("later", MEMBERS, step=5)),
    )
    assert policy.election(T0)[0] is Outcome.WAITING  # only our own vote counts


def test_the_first_step_is_a_genesis_and_a_download_takes_the_electorate_its_holders_name():
    policy = make_policy()
    first = candidate("first", [ME, "z0", "z1"], step=1)
    elect(policy, first, T0)
    assert policy.ballot is not None and policy.ballot.genesis
    read(policy, *(voting(p, first, electorate=first.plan) for p in ("z0", "z1")))
    assert policy.election(T0) == (Outcome.WON, first)
    # Holders of step 3 name its plan; another plan named too must trail it by the quorum
    # (2): a few identities that padded a plan of their own to a tie won it before (the
    # smaller digest), and a downloader then counted their votes (review).
    holders = [
        other(p, step=3, digest="d3", electorate=PLAN.digest, electorate_size=PLAN.size)
        for p in ("z0", "z1", "z2")
    ]
    liars = [
        other(p, step=3, digest="d3", electorate="0" * 32, electorate_size=3)
        for p in ("x0", "x1", "x2")
    ]
    read(policy, *holders)
    assert policy.view.electorate(3, "d3") == PLAN  # uncontested
    read(policy, *holders, liars[0])
    assert policy.view.electorate(3, "d3") == PLAN  # 3 : 1
    read(policy, *holders, *liars[:2])
    assert policy.view.electorate(3, "d3") is None  # 3 : 2, a lead below the quorum
    read(policy, *holders, *liars)
    assert policy.view.electorate(3, "d3") is None  # a tie: nobody's


def test_our_record_names_the_electorate_of_the_state_we_hold():
    policy = at_step_3()
    record = policy.own_record(Local(), T0)
    assert (record.electorate, record.electorate_size) == (PLAN.digest, PLAN.size)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(record), type=ProgressRecord)
    assert decoded == record


def test_a_member_that_left_after_voting_still_counts_through_its_farewell_record():
    """Two peers take step 1; the other wins, reaches max_steps and leaves. Withdrawn, its
    record took its vote along, and our count (1 of 2, one unseen) stalled for ever; its
    `leaving` record keeps the vote (and signatures) while it counts as a trainer no more."""
    policy = make_policy()
    pair = candidate("pair", [ME, "z0"], step=1)
    elect(policy, pair, T0)
    read(policy)  # withdrawn
    assert policy.election(T0)[0] is Outcome.WAITING
    farewell = msgspec.structs.replace(voting("z0", pair, electorate=pair.plan), leaving=True)
    read(policy, farewell)
    assert policy.election(T0) == (Outcome.WON, pair)
    assert policy.view.records == [] and policy.view.farewells == [farewell]


def test_a_genesis_needs_most_of_the_trainers_in_view():
    """100 simulated peers: a stray gathering of 2 certified step 1 in its own plan while 98
    certified another in theirs, and a peer took step 1 as a second state. A genesis now
    needs the votes of more than half of the trainers in view; one whose plan is no such
    majority stalls at once (waiting out the patience kept its peers out of the next
    gathering: 100 simulated peers gathered in alternating halves)."""
    policy = make_policy()
    stray = candidate("stray", [ME, "z0"], step=1)
    elect(policy, stray, T0)
    others = [other(f"z{i}") for i in range(1, 5)]
    read(policy, voting("z0", stray, electorate=stray.plan), *others)
    assert policy.election(T0)[0] is Outcome.STALLED  # 2 of 6 votes at most
    policy.elected(Outcome.STALLED)
    # A plan of 4 of the 6 could still win: its election waits for the votes, then stalls.
    most = make_policy()
    four = candidate("four", [ME, "z0", "z1", "z2"], step=1)
    elect(most, four, T0)
    read(most, voting("z0", four, electorate=four.plan), *others)
    assert most.election(T0)[0] is Outcome.WAITING  # 2 of 6, 2 more may come
    patience = most.election_patience()
    assert most.election(T0 + patience)[0] is Outcome.STALLED
    every = candidate("every", [ME, *(f"z{i}" for i in range(5))], step=1)
    elect(policy, every, T0 + patience)
    votes = [voting(f"z{i}", every, electorate=every.plan) for i in range(4)]
    read(policy, *votes, *others[3:])
    assert policy.election(T0 + patience) == (Outcome.WON, every)  # 5 of 6


def test_a_genesis_split_by_a_departure_counts_the_whole_plans_votes():
    """A member that leaves mid-averaging ends a plan's peers on several averages (40
    simulated peers, 70.8 MB: five bases of one first step), and each votes for its own.
    Round 0 dies, and round 1 certifies its leader with every voter; the majority of the
    trainers a genesis needs is the plan's voters, not the leader's alone: counting the
    leader's, such a first step stalled."""
    members = [ME, *(f"z{i}" for i in range(6))]  # 7 trainers, all in the plan
    split = [candidate(name, members, step=1) for name in ("a-leader", "b-second", "c-third")]
    leader, second, third = split
    plan = leader.plan
    policy = make_policy()
    elect(policy, leader, T0)
    choices = [leader, leader, second, second, third]  # z0..z4; z5 left (its vote never comes)

    def cast(peer_id: str, *votes: Candidate) -> ProgressRecord:  # at step 0, as we are
        records = [VoteRecord.of(Vote(peer_id, c, plan, i)) for i, c in enumerate(votes)]
        record = other(peer_id, vote=records[-1], earlier_votes=records[:-1])
        return msgspec.structs.replace(record, step=0, digest="d0")

    votes = [cast(f"z{i}", c) for i, c in enumerate(choices)]
    leaving = msgspec.structs.replace(other("z5"), leaving=True)
    read(policy, *votes, leaving)
    # 3 for the leader (ours too), 2 and 1 for the others, 1 unseen: none can reach two
    # thirds (5 of 7): round 0 dies, and a vote turn on we vote its leader in round 1.
    assert policy.election(T0) == (Outcome.WAITING, None)
    turn = T0 + policy._vote_turn()
    assert policy.election(turn) == (Outcome.WAITING, None)
    assert policy.last_vote == Vote(ME, leader, plan, 1)
    # The others that read round 0 as we did vote its leader too; 5 of 7 certify it. Its
    # round-1 voters (5) are a majority of the 7 trainers; its round-0 voters (3) were not.
    joined = [cast(f"z{i}", c, leader) for i, c in enumerate(choices[:4])]
    read(policy, *joined, votes[4], leaving)
    assert policy.election(turn) == (Outcome.WON, leader)
    # A reader whose view holds more trainers than the plan's voters and half: no genesis.
    crowded = make_policy()
    elect(crowded, leader, T0)
    read(crowded, *votes, *(other(f"y{i}") for i in range(8)))  # with us, 14 trainers
    assert crowded.election(T0)[0] is Outcome.STALLED  # 7 members of 14 trainers: hopeless
    assert crowded.stall_count == (  # the log says why: the count as it stood
        "votes 3 / 2 / 1 of 7 members, 1 unseen; 14 trainers around (a genesis)"
    )


def genesis_votes(plan: Electorate, *choices: tuple[str, Candidate]) -> list[ProgressRecord]:
    """Round-0 votes of a first step in `plan`, at step 0 as we are."""
    return [
        msgspec.structs.replace(
            other(peer_id, vote=VoteRecord.of(Vote(peer_id, choice, plan))), step=0, digest="d0"
        )
        for peer_id, choice in choices
    ]


def test_after_a_split_a_member_votes_the_round_s_leader_however_few_voted_for_it():
    """300 simulated peers split a first step 48 ways, the largest 19 of 205 votes: a free
    round's leader that needed a third of the electorate left every member on its own
    candidate. Now the round's leader (3 of 10 here) draws the next round's votes."""
    members = [ME, *(f"z{i}" for i in range(9))]
    leader, b, c, d, e = (candidate(name, members, step=1) for name in ("l", "b", "c", "d", "e"))
    policy = make_policy()
    elect(policy, b, T0)  # ours: b, 2 votes with ours
    choices = [leader, leader, leader, b, c, c, d, e]  # z0..z7; z8 left
    read(
        policy,
        *genesis_votes(leader.plan, *((f"z{i}", x) for i, x in enumerate(choices))),
        msgspec.structs.replace(other("z8"), leaving=True),
    )
    assert policy.election(T0) == (Outcome.WAITING, None)  # 3 + 1 unseen: no two thirds
    assert policy.election(T0 + policy._vote_turn())[0] is Outcome.WAITING
    assert policy.last_vote == Vote(ME, leader, leader.plan, 1)


def test_a_few_votes_for_a_candidate_of_another_plan_draw_nobody():
    """Review: members that vote a candidate of a plan of their own lead a split round with a
    plurality; certified, that plan would be the next step's electorate. A member follows
    another plan's leader only with a third of the electorate behind it, else the leader
    among its own plan's candidates."""
    members = [ME, *(f"z{i}" for i in range(9))]
    ours, b, c, d = (candidate(name, members, step=1) for name in ("a", "b", "c", "d"))
    theirs = candidate("x", ["z0", "z1", "z2"], step=1)
    policy = make_policy()
    elect(policy, ours, T0)
    choices = [theirs, theirs, theirs, ours, b, b, c, c, d]  # z0..z8: 3 for theirs
    read(policy, *genesis_votes(ours.plan, *((f"z{i}", x) for i, x in enumerate(choices))))
    assert policy.election(T0 + policy._vote_turn())[0] is Outcome.WAITING
    assert policy.last_vote == Vote(ME, ours, ours.plan, 1)  # 2 each: a, b, c; "a" first


def test_a_genesis_counts_the_trainers_of_recent_reads_not_of_the_last_alone():
    """A read can show part of the collaboration (a progress shard level some writers had
    left): 100 simulated peers with sharded records took step 1 as two states, each won by a
    majority of a partial view. The trainers counted are those of every read in the last
    `Timing.rejoin_after`; leavers go at once."""
    policy = make_policy()
    others = [other(f"z{i}") for i in range(1, 7)]
    read(policy, *others, now=T0 - 1)  # ME and 6 others
    three = candidate("three", [ME, "z1", "z2"], step=1)
    elect(policy, three, T0)
    votes = [  # at step 0, as we are: trainers around our step
        msgspec.structs.replace(voting(f"z{i}", three, three.plan), step=0, digest="d0")
        for i in (1, 2)
    ]
    read(policy, *votes)  # this read shows 3 trainers: all of them vote
    assert policy.election(T0)[0] is Outcome.STALLED  # 3 of the 7 seen a second ago
    policy.elected(Outcome.STALLED)
    # The others leave (their last records say so): three of three win.
    again = make_policy()
    read(again, *others, now=T0 - 1)
    elect(again, three, T0)
    leaving = [msgspec.structs.replace(r, leaving=True) for r in others[2:]]
    read(again, *votes, *leaving)
    assert again.election(T0) == (Outcome.WON, three)
    # Or they were last seen longer ago than `rejoin_after`.
    late = make_policy()
    read(late, *others, now=T0 - late.timing.rejoin_after - 1)
    elect(late, three, T0)
    read(late, *votes)
    assert late.election(T0) == (Outcome.WON, three)


def test_a_partial_average_defers_its_vote_and_joins_the_leader_of_its_plan():
    """A member left mid-averaging: the plan's peers end on several averages (at 100
    simulated peers, 32 / 12 / 12 of one gathering), and with each voting for its own none
    had a majority. A partial average defers its vote by a turn per missing contribution and
    then joins the candidate of its plan that members' votes lead (here 2 of a plan of 6:
    more than ours would have, and a third of the plan)."""
    step4 = [*MEMBERS, "z4"]
    ours, larger = candidate("ours", step4), candidate("larger", step4)
    policy = at_step_3()
    gathering = T0 - 30.0
    policy.elect(ours, MEMBERS_OF[ours], T0, basis=len(step4) - 2, gathering=gathering)
    ballot = policy.ballot
    assert ballot is not None and ballot.vote is None and ballot.vote_at is not None
    turn = policy.timing.fallback_turn(policy.store_seconds)
    assert ballot.vote_at == T0 + 2 * turn
    read(policy, voting("z0", larger), voting("z1", larger))
    assert policy.election(T0 + 2 * turn - 0.1) == (Outcome.WAITING, None)
    assert policy.last_vote is None or policy.last_vote.candidate.step != 4
    # Until it votes, our record shows the gathering's call: members counting meanwhile
    # wait for our vote (`_members_averaging`) rather than give up on it.
    record = policy.own_record(Local(), T0)
    assert (record.call_step, record.gather_until) == (3, gathering)
    policy.election(T0 + 2 * turn)  # the vote is cast: for the leader
    assert policy.last_vote == Vote(ME, larger, PLAN)
    assert policy.own_record(Local(), T0).call_step == -1
    read(policy, voting("z0", larger), voting("z1", larger), voting("z2", larger))
    assert policy.election(T0 + 2 * turn + 1) == (Outcome.LOST, larger)  # we download it

    # Certified before our deferred vote is due: the election ends, and the call with it.
    early = at_step_3()
    early.elect(ours, MEMBERS_OF[ours], T0, basis=len(step4) - 2, gathering=gathering)
    read(early, *(voting(f"z{i}", larger) for i in range(4)))
    assert early.election(T0) == (Outcome.LOST, larger)
    early.elected(Outcome.LOST)
    assert early.own_record(Local(), T0).call_step == -1

    # One member's vote is a claim, not evidence: we vote for ours.
    alone = at_step_3()
    alone.elect(ours, MEMBERS_OF[ours], T0, basis=len(step4) - 1)
    read(alone, voting("z0", larger))
    alone.election(T0 + turn)
    assert alone.last_vote == Vote(ME, ours, PLAN)
    # Nor a candidate of another plan (another gathering), however many vote for it.
    elsewhere = candidate("elsewhere", [*MEMBERS, "z9"])
    apart = at_step_3()
    apart.elect(ours, MEMBERS_OF[ours], T0, basis=len(step4) - 1)
    read(apart, voting("z0", elsewhere), voting("z1", elsewhere), voting("z2", elsewhere))
    apart.election(T0 + turn)
    assert apart.last_vote == Vote(ME, ours, PLAN)
    # A complete average votes at once.
    whole = at_step_3()
    whole.elect(ours, MEMBERS_OF[ours], T0, basis=len(step4))
    assert whole.last_vote == Vote(ME, ours, PLAN)


def test_a_deferred_vote_is_drawn_only_by_a_third_of_the_plan_and_never_cast_twice():
    """Review: two colluding members voting for a candidate they invented drew every
    deferred vote, and the step was certified on a state nobody could serve. A leader needs
    the votes of a third of the plan's members. And a vote of ours that our old record (from
    before a restart) shows up with during the delay is carried, not cast again."""
    step4 = [*MEMBERS, "z4", "z5", "z6", "z7"]  # a plan of 9: a third is 3
    ours, invented = candidate("ours", step4), candidate("0-invented", step4)
    policy = at_step_3()
    policy.elect(ours, MEMBERS_OF[ours], T0, basis=len(step4) - 1)
    turn = policy.ballot.vote_at - T0  # type: ignore[union-attr]
    read(policy, voting("z0", invented), voting("z1", invented))  # two colluders
    policy.election(T0 + turn)
    assert policy.last_vote == Vote(ME, ours, PLAN)
    # Three members (a third of 9): evidence enough.
    drawn = at_step_3()
    drawn.elect(ours, MEMBERS_OF[ours], T0, basis=len(step4) - 1)
    read(drawn, *(voting(p, invented) for p in ("z0", "z1", "z2")))
    drawn.election(T0 + turn)
    assert drawn.last_vote == Vote(ME, invented, PLAN)

    restarted = at_step_3()
    restarted.elect(ours, MEMBERS_OF[ours], T0, basis=len(step4) - 1)
    old = candidate("old", step4)
    read(restarted, voting(ME, old))  # our record from before the restart, read late
    assert restarted.election(T0 + turn)[0] is Outcome.WAITING
    assert restarted.last_vote == Vote(ME, old, PLAN)  # carried, not a second vote
    assert restarted.ballot is not None and restarted.ballot.vote is None


def test_a_deferred_vote_does_not_wait_once_the_count_is_decided():
    """Review: a peer whose vote was deferred waited out its turns although the others had
    already certified a candidate, and missed the next gathering."""
    step4 = [*MEMBERS, "z4"]
    ours, larger = candidate("ours", step4), candidate("larger", step4)
    policy = at_step_3()
    policy.elect(ours, MEMBERS_OF[ours], T0, basis=len(step4) - 2)
    read(policy, *(voting(p, larger) for p in ("z0", "z1", "z2", "z3")))
    assert policy.election(T0) == (Outcome.LOST, larger)  # 4 of 5: certified, at once


def test_one_members_vote_in_a_high_round_holds_nobody_out_of_the_next():
    """Review: entering the highest round voted in, one member's vote in round 7 made every
    other member wait for ever (round 6's unseen could still reach two thirds). A member
    enters the highest round the votes let it: here round 1, as round 0 died 2 : 2."""
    policy = at_step_3()
    elect(policy, BIG, T0)
    high = VoteRecord.of(Vote("z3", SMALL, PLAN, 7))
    records = [voting("z0", BIG), voting("z1", SMALL), voting("z2", SMALL)]
    read(policy, *records, other("z3", step=3, digest="d3", vote=high))
    assert policy.election(T0 + policy._vote_turn())[0] is Outcome.WAITING
    assert policy.last_vote is not None and policy.last_vote.round == 1


def test_a_downloader_that_is_no_member_never_votes_nor_counts_a_vote_of_its_own():
    """Review: "s" knows the members of step 3's plan (its donor's list) but is none of them.
    It cast a vote from its election loop and counted it: 3 members' votes and its own won
    it a step that the members' count had not certified."""
    joined = candidate("joined", [*MEMBERS, "s"])
    policy = at_step_3(member=False, me="s")
    assert policy.learn_members(MEMBERS)
    elect(policy, joined)
    read(policy, *(voting(p, joined) for p in MEMBERS[1:4]))
    later = T0 + 2 * policy._vote_turn()
    assert policy.election(later) == (Outcome.WAITING, None)
    assert policy.last_vote is None
    read(policy, *(voting(p, joined) for p in MEMBERS[1:5]))
    assert policy.election(later) == (Outcome.WON, joined)  # 4 of 5 members


def test_a_member_without_a_candidate_abstains_where_others_voted_and_follows_the_rounds():
    """A member of the step's electorate whose averaging failed (or that missed the
    gathering) cast no vote and stayed unseen: 39 of 95 at 100 simulated peers, and no round
    could certify or die. Now it abstains in a round where a third of the electorate voted
    for candidates (not before: a few votes, or none, and it would only spend the round),
    once; then it votes only a candidate the rounds force, in the round above the highest."""
    policy = at_step_3()
    local = Local(samples=8, samples_per_second=10.0)
    failed = policy.averaged(
        AveragingResult(peers_seen=5, skipped=["round 0: incomplete"]), 8, T0, T0
    )
    assert not failed.step and (4, PLAN) not in policy._cast_votes  # nobody voted: no abstention
    turn = policy._vote_turn()
    read(policy, voting("z0", BIG))  # 1 of 5 voted: less than a third
    policy.next_action(local, T0 + turn)
    assert (4, PLAN) not in policy._cast_votes
    # z0 and z1 vote BIG, z2 SMALL; z3 unseen. A vote turn on, we abstain in round 0.
    records = [voting("z0", BIG), voting("z1", BIG), voting("z2", SMALL)]
    read(policy, *records)
    policy.next_action(local, T0 + 1.5 * turn)
    assert (4, PLAN) not in policy._cast_votes  # a vote turn after the last try, not before
    policy.next_action(local, T0 + 2 * turn)
    assert policy.last_vote == Vote(ME, abstention(4, PLAN), PLAN, 0)
    record = policy.own_record(local, T0 + 2 * turn)  # on the wire and back, as others read it
    decoded = msgspec.msgpack.decode(encode_progress(record), type=ProgressRecord)
    assert decoded.vote is not None and decoded.vote.vote(ME) == policy.last_vote
    # Round 0: BIG 2, SMALL 1, 1 abstained, z3 unseen: BIG could reach 3 of 5, not 4: dead.
    # Round 1 is free: no vote of ours there (a leader we cannot check, or a second
    # abstention that would spend it).
    policy.next_action(local, T0 + 3 * turn)
    assert [v.round for v in policy._cast_votes[(4, PLAN)]] == [0]
    # The three vote BIG in round 1: with us and z3 unseen there, BIG is the one candidate
    # that could win it, so round 2 is forced to BIG: we vote it there.
    read(policy, *(rounds(p, c, BIG) for p, c in (("z0", BIG), ("z1", BIG), ("z2", SMALL))))
    policy.next_action(local, T0 + 4 * turn)
    assert policy.last_vote == Vote(ME, BIG, PLAN, 2)


def test_without_a_candidate_nobody_spends_a_round_that_no_member_voted_in():
    """Every member's averaging failed: each would abstain in round 0, it would die, and the
    next, and so on: all eight rounds spent, one a vote turn, before a retry brings one
    candidate. No abstention where no member voted for a candidate."""
    policy = at_step_3()
    policy.averaged(AveragingResult(peers_seen=5, skipped=["round 0: incomplete"]), 8, T0, T0)
    none = abstention(4, PLAN)
    read(policy, *(rounds(f"z{i}", none) for i in range(4)))
    for turn in range(1, 4):
        policy.next_action(Local(samples=8, samples_per_second=10.0), T0 + turn * 10.0)
    assert (4, PLAN) not in policy._cast_votes


def test_a_stalled_count_is_the_highest_round_s():
    """The log's count of a stalled election: the highest round voted in, abstentions apart.
    Summed over every round, 98 members showed "votes 213 / 154 / ... , -550 unseen"."""
    policy = at_step_3()
    elect(policy, BIG, T0)
    none = abstention(4, PLAN)
    votes = [
        Vote("z0", SMALL, PLAN, 0),
        Vote("z0", BIG, PLAN, 1),
        Vote("z1", BIG, PLAN, 0),
        Vote("z1", SMALL, PLAN, 1),
        Vote("z2", none, PLAN, 1),
    ]
    assert policy._stalled(votes) is Outcome.STALLED
    assert policy.stall_count == "votes 1 / 1 of 5 members in round 1, 1 abstained, 2 unseen"


def test_rounds_are_left_for_a_retry_when_a_lone_candidate_meets_members_without_one():
    """A review's case, five honest policies on one clock: z0 holds candidate A (a partial
    average), the four others' averaging failed. Before, z0 voted A a round higher every vote
    turn and the four abstained after it, so all eight rounds were spent in 30 s, and the
    retry that gave all five candidate B had no round left: the step never moved. Now z0
    waits (no leader to join, the same vote a round higher), the four abstain at most once
    and only beside a third of the electorate's votes, and the retry certifies B for all."""
    policies = {m: at_step_3(me=m) for m in MEMBERS}
    lone = Candidate(4, "a-lone", PLAN)
    policies["z0"].elect(lone, frozenset(MEMBERS), T0)
    failed = AveragingResult(peers_seen=5, skipped=["round 0: incomplete"])
    for peer_id, policy in policies.items():
        if peer_id != "z0":
            policy.averaged(failed, 8, T0, T0)
    local = Local(samples=8, samples_per_second=10.0)

    def tick(now: float) -> None:
        records = [p.own_record(local, now) for p in policies.values()]
        for p in policies.values():
            p.observe(CollaborationView(records, 2), now)

    now = T0
    while now < T0 + 60:
        now += 1.0
        tick(now)
        holder = policies["z0"]
        if holder.ballot is not None:
            outcome, _ = holder.election(now)
            if outcome is not Outcome.WAITING:
                holder.elected(outcome)
        for peer_id, policy in policies.items():
            if peer_id != "z0":
                policy.next_action(local, now)
    spent = max(v.round for p in policies.values() for v in p._cast_votes.get((4, PLAN), []))
    assert spent <= 1
    retry = Candidate(4, "b-retry", PLAN)
    for policy in policies.values():
        policy.elect(retry, frozenset(MEMBERS), now)
    outcomes: dict[str, tuple[Outcome, Candidate | None]] = {}
    start = now
    while now < start + 60 and len(outcomes) < len(policies):
        now += 1.0
        tick(now)
        for peer_id, policy in policies.items():
            if peer_id not in outcomes:
                outcome, certified = policy.election(now)
                if outcome is not Outcome.WAITING:
                    policy.elected(outcome)
                    outcomes[peer_id] = (outcome, certified)
    assert outcomes == dict.fromkeys(MEMBERS, (Outcome.WON, retry))


def test_a_member_does_not_carry_its_own_candidate_up_a_round_with_no_leader_to_join():
    """Round 0 split A / B / C, two abstained: it died, and no candidate had a third of the
    electorate. Our own candidate again, a round higher, would repeat the split and spend a
    round (a review: one member's candidate climbed all eight rounds alone); we wait for a
    leader, a forced candidate, or a retry's candidate."""
    policy = at_step_3()
    ours = candidate("a-ours", MEMBERS)
    elect(policy, ours, T0)
    assert policy.last_vote == Vote(ME, ours, PLAN, 0)
    none = abstention(4, PLAN)
    b, c = candidate("b", MEMBERS), candidate("c", MEMBERS)
    read(policy, voting("z0", b), voting("z1", c), voting("z2", none), voting("z3", none))
    for turn in (1, 2, 3):
        assert policy.election(T0 + turn * policy._vote_turn())[0] is Outcome.WAITING
    assert [v.round for v in policy._cast_votes[(4, PLAN)]] == [0]
    # A retry's candidate of ours: a new vote, in round 1 (free).
    retry = candidate("d-retry", MEMBERS)
    policy.elected(Outcome.STALLED)
    elect(policy, retry, T0 + 10)
    policy.election(T0 + 10 + policy._vote_turn())
    assert policy.last_vote == Vote(ME, retry, PLAN, 1)
    # Others voting in a round, with no leader: we vote there too, our own (our vote settles
    # the round, as every member's must).
    joined = at_step_3()
    elect(joined, ours, T0)
    read(joined, rounds("z0", b, b), rounds("z1", c, c), voting("z2", none), voting("z3", none))
    joined.election(T0 + joined._vote_turn())
    assert joined.last_vote == Vote(ME, ours, PLAN, 1)


def test_a_member_that_missed_the_gathering_abstains():
    """A member of the step's electorate that sees its gathering close before it could
    declare (it was downloading, or its read came late) has no candidate: it abstains beside
    the members' votes, at once, rather than stay unseen."""
    policy = at_step_3()
    call = other("z3", step=3, digest="d3", call_step=3, gather_until=T0 + 0.1, holding=True)
    read(policy, voting("z0", BIG), voting("z1", BIG), call)
    policy.next_action(Local(samples=8, samples_per_second=10.0), T0)
    assert policy.last_vote == Vote(ME, abstention(4, PLAN), PLAN, 0)
