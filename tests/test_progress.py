"""Progress records and the collaboration's view of them (pure)."""

from __future__ import annotations

import math

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from peer.dht.records import Entry
from peer.training.certificate import StepSignature, sign_step
from peer.training.progress import (
    CollaborationView,
    Moves,
    ProgressRecord,
    company,
    decode_progress,
    encode_progress,
    should_call,
)
from tests.helpers import new_identity

IDENTITIES = [new_identity() for _ in range(6)]
PEERS = [identity.peer_id.to_base58() for identity in IDENTITIES]
COLLAB = "c"


def signature(i: int, step: int, digest: str, collaboration: str = COLLAB) -> StepSignature:
    key = IDENTITIES[i].key_pair.private_key
    return sign_step(key, PEERS[i], collaboration, step, digest)


def rec(i: int, *, cosigners: tuple[int, ...] = (), **fields) -> ProgressRecord:
    """Peer i's record, signed by itself (and `cosigners`) for its step and digest."""
    base = dict(
        peer_id=PEERS[i],
        role="trainer",
        addrs=[],
        step=3,
        digest="d",
        samples=0,
        samples_per_second=0.0,
        updated_at=1.0,
    )
    values = {**base, **fields}
    if "signatures" not in fields:
        values["signatures"] = [
            signature(j, values["step"], values["digest"]) for j in (i, *cosigners)
        ]
    return ProgressRecord(**values)


def entry(value: bytes) -> Entry:
    return Entry(value=value, expiration=2e9)


def test_decode_keeps_only_owner_subkeys_naming_themselves_with_finite_figures():
    good = rec(0, samples=5)
    entries = {
        PEERS[0]: entry(encode_progress(good)),
        PEERS[1]: entry(encode_progress(rec(2))),  # names someone else
        "open-subkey": entry(encode_progress(rec(3))),
        PEERS[2]: entry(b"\x93junk"),
        PEERS[3]: entry(encode_progress(rec(3, loss=math.nan))),
    }
    assert decode_progress(entries, collaboration=COLLAB) == [good]


def test_bytes_decoded_before_are_judged_again_for_each_read():
    """Decoding is remembered by the record's bytes, its checks are not: the same bytes read
    under another peer's subkey, or in another collaboration, are judged as the first time."""
    record = rec(0, cosigners=(1,))
    raw = encode_progress(record)
    assert decode_progress({PEERS[0]: entry(raw)}, collaboration=COLLAB) == [record]
    assert decode_progress({PEERS[1]: entry(raw)}, collaboration=COLLAB) == []
    [elsewhere] = decode_progress({PEERS[0]: entry(raw)}, collaboration="elsewhere")
    assert elsewhere.signatures == []
    assert decode_progress({PEERS[0]: entry(raw)}, collaboration=COLLAB) == [record]


def test_only_records_of_a_records_size_are_remembered():
    """What strangers write is remembered only up to `DECODED_RECORD_BYTES` a record: a few MB
    in all, however large the values they sign."""
    from peer.training import progress

    large = rec(0, addrs=["/ip4/127.0.0.1/tcp/1/" + "x" * 230] * 16)
    raw = encode_progress(large)
    assert len(raw) > progress.DECODED_RECORD_BYTES
    progress._decoded.cache_clear()  # a full memo (the tests run before in this process) grows no more
    before = progress._decoded.cache_info().currsize
    assert decode_progress({PEERS[0]: entry(raw)}, collaboration=COLLAB) == [large]
    assert progress._decoded.cache_info().currsize == before
    small = encode_progress(rec(0, samples=7))
    decode_progress({PEERS[0]: entry(small)}, collaboration=COLLAB)
    assert progress._decoded.cache_info().currsize == before + 1


def test_decode_rejects_negative_steps():
    raw = msgspec.msgpack.encode({**msgspec.structs.asdict(rec(0)), "step": -1})
    assert decode_progress({PEERS[0]: entry(raw)}, collaboration=COLLAB) == []


def test_decode_bounds_a_records_rounds_and_its_earlier_votes():
    """A vote's round is below `MAX_ROUNDS` and a record carries at most `MAX_ROUNDS` - 1
    earlier votes: a record past either is dropped, whatever else it says."""
    from peer.training.progress import VoteRecord
    from peer.training.steprule import MAX_ROUNDS

    def vote(round_: int) -> VoteRecord:
        return VoteRecord(4, "a", "p", 3, "e", 3, round_)

    ok = rec(0, vote=vote(MAX_ROUNDS - 1), earlier_votes=[vote(r) for r in range(MAX_ROUNDS - 1)])
    high = rec(1, vote=vote(MAX_ROUNDS))
    many = rec(2, vote=vote(1), earlier_votes=[vote(0)] * MAX_ROUNDS)
    entries = {PEERS[i]: entry(encode_progress(r)) for i, r in enumerate((ok, high, many))}
    assert decode_progress(entries, collaboration=COLLAB) == [ok]
    assert len(CollaborationView([ok]).votes(4)) == MAX_ROUNDS


def test_global_step_samples_and_eta_count_only_trainers_at_the_step():
    view = CollaborationView(
        [
            rec(0, samples=100, samples_per_second=10.0),
            rec(1, samples=50, samples_per_second=30.0),
            rec(2, step=2, samples=1000, samples_per_second=100.0),
            rec(3, role="keeper", step=3),
        ]
    )
    assert view.global_step == 3
    assert view.samples(3) == 150 and view.throughput(3) == 40.0
    assert view.eta(3, 350) == 5.0
    assert view.eta(3, 100) == 0.0
    assert math.isinf(CollaborationView([rec(0)]).eta(3, 10))


def test_a_step_is_called_when_the_projected_samples_reach_the_target():
    view = CollaborationView([rec(0, samples=80, samples_per_second=10.0)])  # published at 1.0

    def call(target: int, *, now: float = 1.0, window: float = 2.0) -> bool:
        return should_call(view, 3, target_batch=target, window=window, now=now, horizon=4.0)

    assert not call(101) and call(100)
    assert not call(121, now=3.0) and call(120, now=3.0)  # 2 s since its record: 20 more
    assert not call(141, now=9.0) and call(140, now=9.0)  # projected at most `horizon` on
    assert not should_call(view, 4, target_batch=1, window=2.0, now=1.0, horizon=4.0)


def test_a_holding_peer_counts_as_it_stands_and_adds_no_throughput():
    """A peer whose part of the step is done stops computing: projecting its rate on would
    make the others stop short of the target."""
    view = CollaborationView(
        [
            rec(0, samples=80, samples_per_second=10.0, holding=True),
            rec(1, samples=30, samples_per_second=5.0),
            rec(2, samples=500, samples_per_second=50.0, downloading=True, step=3),
        ]
    )
    assert view.projected_samples(3, now=3.0, horizon=4.0) == 80 + 30 + 10 + 500
    assert view.computing_throughput(3) == 55.0 and view.throughput(3) == 65.0


def test_a_peer_that_missed_a_call_looks_for_the_next_one():
    view = CollaborationView(
        [rec(0, call_step=3, gather_until=10.0), rec(1, call_step=3, gather_until=14.0)]
    )
    assert view.call(3) == 10.0
    assert view.call(3, after=10.0) == 14.0  # the missed gathering no longer hides this one
    assert view.call(3, after=14.0) is None


def test_the_earliest_call_wins_and_with_record_replaces_our_own():
    view = CollaborationView([rec(0, call_step=3, gather_until=12.0), rec(1)])
    assert view.call(3) == 12.0 and view.call(4) is None
    mine = view.with_record(rec(1, call_step=3, gather_until=11.5))
    assert mine.call(3) == 11.5 and len(mine.records) == 2


def test_a_view_with_our_record_counts_the_signers_a_view_of_its_records_counts():
    """`with_record` works the others' signers out once a view and adds ours: the signatures
    only our old record carried count no more, and a leaving record's still count."""
    farewell = rec(4, leaving=True, cosigners=(5,))
    view = CollaborationView([rec(0, cosigners=(1,)), rec(1), rec(2, cosigners=(3,)), farewell])
    assert view.signers(3, "d") == {PEERS[i] for i in range(6)}
    for ours in [rec(2, step=4, digest="e"), rec(2, cosigners=(0,)), rec(2, leaving=True)]:
        mine = view.with_record(ours)
        fresh = CollaborationView([*mine.records, *mine.farewells], mine.quorum)
        for step, digest in [(3, "d"), (4, "e")]:
            assert mine.signers(step, digest) == fresh.signers(step, digest)
    assert view.with_record(rec(2, step=4, digest="e")).signers(3, "d") == {
        PEERS[i] for i in (0, 1, 4, 5)
    }


@given(
    st.lists(st.integers(0, 5), max_size=6, unique=True),
    st.integers(0, 5),
    st.booleans(),
)
def test_with_record_is_the_records_with_ours_in_place_in_peer_id_order(held, ours, shuffled):
    """A view of a read (records in peer id order) splices our record in where a sort puts
    it, replacing our old one, and one in another order is sorted: the same records either
    way."""
    records = sorted((rec(i, samples=i) for i in held), key=lambda r: r.peer_id)
    if shuffled:
        records.reverse()
    mine = rec(ours, samples=99)
    view = CollaborationView(records).with_record(mine)
    expected = sorted(
        [*(r for r in records if r.peer_id != mine.peer_id), mine], key=lambda r: r.peer_id
    )
    assert view.records == expected


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(2, 4), st.booleans()), max_size=6),
    st.tuples(st.integers(0, 5), st.integers(2, 4), st.booleans(), st.booleans()),
    st.booleans(),
    st.integers(2, 4),
)
def test_what_a_view_keeps_is_the_filter_of_its_records(held, ours, shuffled, step):
    """`kept` of a view with our record in it (`with_record`: the others filtered once a
    read) is the filter of that view's records, in their order, as is a read's own (worked
    out once); read again, the same; our record leaving, not in it."""
    records = [rec(i, step=s, digest="d", holding=h) for i, s, h in held]
    records = list({r.peer_id: r for r in records}.values())
    records.sort(key=lambda r: r.peer_id, reverse=shuffled)
    i, s, h, leaving = ours
    view = CollaborationView(records)
    mine = view.with_record(rec(i, step=s, digest="d", holding=h, leaving=leaving))
    for v in (view, mine, mine):  # a second asker of the same key gets the same
        for key, keep in [
            (("trainers", step), lambda r: r.role == "trainer" and r.step == step),
            (("holding", step), lambda r: r.holding and r.step <= step),
        ]:
            assert v.kept(key, keep) == [r for r in v.records if keep(r)]
        assert v.trainers(step) == [r for r in v.records if r.step == step]


@given(st.lists(st.integers(0, 5), max_size=8), st.integers(0, 5), st.booleans())
def test_record_of_finds_a_peers_first_record_in_any_view(held, wanted, in_order):
    """A read's view (peer ids ascending) finds a record by bisection; any other view (out of
    order, or the same peer twice) gives its first."""
    records = [rec(i, samples=n) for n, i in enumerate(held)]
    if in_order:
        records = sorted({r.peer_id: r for r in records}.values(), key=lambda r: r.peer_id)
    first = next((r for r in records if r.peer_id == PEERS[wanted]), None)
    assert CollaborationView(records).record_of(PEERS[wanted]) is first


def test_consensus_is_the_most_common_digest_and_ties_break_by_the_smallest():
    view = CollaborationView([rec(0, digest="b"), rec(1, digest="b"), rec(2, digest="a")])
    assert view.consensus(3) == "b"
    assert [r.peer_id for r in view.donors(3)] == sorted([PEERS[0], PEERS[1]])
    tie = CollaborationView([rec(0, digest="b"), rec(1, digest="a")])
    assert tie.consensus(3) == "a"
    keeper_last = CollaborationView([rec(0, role="keeper"), rec(1)])
    assert [r.role for r in keeper_last.donors(3)] == ["trainer", "keeper"]


def test_newest_validation_loss():
    view = CollaborationView(
        [
            rec(0, validation_loss=2.0, validation_step=10),
            rec(1, validation_loss=1.5, validation_step=20),
            rec(2),
        ]
    )
    assert view.validation_loss() == (20, 1.5)
    assert CollaborationView([rec(0)]).validation_loss() is None


def test_company_those_behind_and_when_the_collaboration_has_settled():
    view = CollaborationView(
        [rec(0), rec(1, digest="e"), rec(2, step=2), rec(3, role="keeper", step=4), rec(4, step=5)]
    )
    # Trainers at our step or beyond (not us, not keepers), and those behind only while their
    # step moves (catching up).
    moves = Moves()
    moves.note(view, now=100.0)
    assert moves.since[PEERS[2]] == (2, 100.0)  # appeared
    in_company = [r.peer_id for r in company(view, 3, PEERS[0], moves, within=30, now=120.0)]
    assert in_company == [PEERS[1], PEERS[2], PEERS[4]]
    moves.note(view, now=140.0)  # peer 2 still at step 2
    in_company = [r.peer_id for r in company(view, 3, PEERS[0], moves, within=30, now=140.0)]
    assert in_company == [PEERS[1], PEERS[4]]
    moved = CollaborationView([*view.records[:2], rec(2, step=3), *view.records[3:]])
    moves.note(moved, now=141.0)
    assert moves.since[PEERS[2]] == (3, 141.0) and moves.since[PEERS[1]] == (3, 100.0)
    moves.note(CollaborationView([rec(1)]), now=142.0)
    assert list(moves.since) == [PEERS[1]]  # those gone are forgotten
    assert [r.peer_id for r in view.catching_up(3)] == [PEERS[2]]
    fetching = CollaborationView([rec(0), rec(1, downloading=True)])
    assert [r.peer_id for r in fetching.catching_up(3)] == [PEERS[1]]
    assert not fetching.settled(3, "d")  # its digest is about to change
    view = CollaborationView(
        [rec(0), rec(1, digest="e"), rec(2, step=2), rec(3, role="keeper", step=1)]
    )
    assert not view.settled(3, "d")  # peer 1 holds another digest, peer 2 is behind
    assert CollaborationView([rec(0), rec(1), rec(3, role="keeper", step=1)]).settled(3, "d")
    assert not CollaborationView([rec(0), rec(1)]).settled(4, "d")


# ---------------------------------------------------------------------------- certificates


def test_decode_keeps_only_signatures_of_the_records_own_step_and_digest():
    """A signature is its signer's over (collaboration, step, digest): one copied onto another
    digest or step, made for another collaboration, or claiming another signer is dropped."""
    honest = signature(1, 3, "d")
    record = rec(
        0,
        signatures=[
            signature(0, 3, "d"),
            honest,
            signature(2, 3, "other digest"),  # another statement
            signature(3, 4, "d"),  # another step
            signature(4, 3, "d", collaboration="elsewhere"),
            StepSignature(PEERS[5], honest.signature),  # someone else's bytes
            StepSignature("not a peer id", b"x" * 64),
            StepSignature(PEERS[2], b"short"),
        ],
    )
    [decoded] = decode_progress({PEERS[0]: entry(encode_progress(record))}, collaboration=COLLAB)
    assert [s.signer for s in decoded.signatures] == sorted([PEERS[0], PEERS[1]])


def test_a_lone_record_claiming_a_higher_step_moves_nobody():
    """The hijack: one peer publishes step 9 (any digest it likes). Before, the global step
    was the highest any record reported, so every peer downloaded that peer's state."""
    honest = [rec(0, cosigners=(1,)), rec(1, cosigners=(0,)), rec(2, cosigners=(0, 1))]
    liar = rec(3, step=9, digest="poison")
    view = CollaborationView([*honest, liar], quorum=2)
    assert view.global_step == 3
    assert not view.certified(9, "poison") and view.consensus(9) is None and not view.donors(9)
    assert view.consensus(3) == "d"
    # A record can copy others' signatures only for what they signed: 9/poison gains nothing.
    copied = rec(3, step=9, digest="poison", signatures=[*honest[0].signatures])
    raw = {PEERS[3]: entry(encode_progress(copied))}
    assert not CollaborationView(decode_progress(raw, collaboration=COLLAB), 2).certified(
        9, "poison"
    )
    # Two signers certify; the quorum is `averaging.min_group_size`.
    pair = CollaborationView([*honest, liar, rec(4, step=9, digest="poison", cosigners=(3,))], 2)
    assert pair.global_step == 9
    assert CollaborationView([*honest, liar], quorum=1).global_step == 9


def test_a_lone_record_at_our_step_with_another_digest_wins_no_tie():
    """Before, the most common digest won and ties went to the smallest: a liar at a lone
    peer's step with a smaller digest made it download the liar's state."""
    view = CollaborationView([rec(0, digest="m", cosigners=(1,)), rec(2, digest="a")], quorum=2)
    assert view.consensus(3) == "m"
    assert CollaborationView([rec(2, digest="a")], quorum=2).consensus(3) is None
    # Two certified digests (two groups that averaged apart): most signers, then the smallest.
    split = CollaborationView(
        [rec(0, digest="b", cosigners=(1, 2)), rec(3, digest="a", cosigners=(4,))], quorum=2
    )
    assert split.consensus(3) == "b"
    even = CollaborationView(
        [rec(0, digest="b", cosigners=(1,)), rec(3, digest="a", cosigners=(4,))], quorum=2
    )
    assert even.consensus(3) == "a"


def test_step_zero_needs_no_signature():
    """Every peer builds the initial state from the task itself."""
    view = CollaborationView([rec(0, step=0, signatures=[]), rec(1, step=0, signatures=[])], 2)
    assert view.global_step == 0 and view.consensus(0) == "d"


def test_a_call_gathering_further_ahead_than_the_latest_is_ignored():
    """The freeze: one peer called the next step 11 days ahead; the earliest call wins, so
    no other call ever did."""
    eleven_days = 11 * 86400.0
    view = CollaborationView([rec(0, call_step=3, gather_until=100.0 + eleven_days)])
    assert view.call(3) is not None  # what the rule was
    assert view.call(3, latest=120.0) is None
    both = CollaborationView([*view.records, rec(1, call_step=3, gather_until=110.0)])
    assert both.call(3, latest=120.0) == 110.0


def test_the_target_loss_needs_a_quorum_of_reports():
    """The stop: one peer reported a validation loss below the target, and the newest report
    ended everyone's training."""
    liar = rec(0, validation_loss=0.01, validation_step=99)
    honest = [rec(1, validation_loss=3.0, validation_step=10), rec(2)]
    assert not CollaborationView([liar, *honest], quorum=2).target_reached(2.9)
    assert CollaborationView([liar, *honest], quorum=1).target_reached(2.9)
    agreeing = [liar, rec(1, validation_loss=2.8, validation_step=10), rec(2)]
    assert CollaborationView(agreeing, quorum=2).target_reached(2.9)
    keeper = rec(3, role="keeper", validation_loss=0.1)
    assert not CollaborationView([liar, keeper], quorum=2).target_reached(2.9)


def test_a_view_for_a_fingerprint_holds_only_the_records_of_that_task():
    view = CollaborationView(
        [rec(0, fingerprint="a"), rec(1, fingerprint="b"), rec(2, fingerprint="a")], quorum=2
    )
    assert [r.peer_id for r in view.training("a").records] == [PEERS[0], PEERS[2]]
    assert view.training("a").quorum == 2
    # Worked out once a read: the trainer asks for it twice (its signers and global step too).
    assert view.training("a") is view.training("a")
    assert [r.peer_id for r in view.training("b").records] == [PEERS[1]]


def test_a_foreign_task_is_one_whose_peers_hold_a_certified_step_while_ours_hold_none():
    theirs = dict(fingerprint="gpt", task="task 'gpt' (...)", step=5, digest="g")
    joiner = rec(0, fingerprint="tiny", task="task 'tiny'", step=0, digest="t")
    collaboration = CollaborationView(
        [joiner, rec(1, cosigners=(2,), **theirs), rec(2, cosigners=(1,), **theirs)], quorum=2
    )
    found = collaboration.foreign_task("tiny")
    assert found is not None and (found.task, found.step) == ("task 'gpt' (...)", 5)
    # To the collaboration's own peers nothing is foreign.
    assert collaboration.foreign_task("gpt") is None
    # One peer's word (a single signer, below the quorum) turns nobody away ...
    lone = CollaborationView([joiner, rec(1, **theirs)], quorum=2)
    assert lone.foreign_task("tiny") is None
    # ... nor does a certified other task once ours has certified steps of its own.
    ours = dict(fingerprint="tiny", step=2, digest="t2")
    both = CollaborationView(
        [*collaboration.records, rec(3, cosigners=(4,), **ours), rec(4, cosigners=(3,), **ours)],
        quorum=2,
    )
    assert both.foreign_task("tiny") is None
