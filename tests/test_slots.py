"""Connection slots per network prefix and the accept-rate budget (`peer.net.slots`), by hand:
synchronous, the clock passed in."""

from __future__ import annotations

import pytest

from peer.net.slots import AcceptBudget, ListenerLimits, Slots, SlotStatistics

# -- slots ------------------------------------------------------------------------------------


def test_addresses_of_one_prefix_share_its_slots():
    """Five addresses of one /24 (or of one IPv6 /64) hold what one address would."""
    slots: Slots[str] = Slots(max_total=32, max_per_prefix=8)
    for n in range(40):
        slots.take(f"conn{n}", f"10.1.2.{2 + n % 5}")
    assert slots.held("10.1.2.200") == 8 and len(slots) == 8
    for n in range(12):
        slots.take(f"v6-{n}", f"2001:db8:1:2::{n + 1:x}")
    assert slots.held("2001:db8:1:2:ffff::1") == 8 and slots.held("2001:db8:1:3::1") == 0
    assert slots.take("other", "10.1.3.1") == (True, [])  # the next /24 has its own


def test_a_newcomer_from_a_prefix_at_its_cap_takes_that_prefixs_oldest_slot():
    """Not refused: idle connections from an attacker sharing a member's address cannot keep
    the member out; the attacker's oldest makes room, and the member's is the youngest."""
    slots: Slots[str] = Slots(max_total=8, max_per_prefix=3)
    for name in ("idle1", "idle2", "idle3"):
        assert slots.take(name, "192.0.2.7") == (True, [])
    assert slots.take("member", "192.0.2.7") == (True, ["idle1"])
    assert slots.take("idle1-again", "192.0.2.9") == (True, ["idle2"])
    assert slots.take("idle2-again", "192.0.2.7") == (True, ["idle3"])
    assert slots.take("idle3-again", "192.0.2.7") == (True, ["member"])  # 3 fresh ones later
    assert slots.statistics().evicted == 4 and slots.statistics().refused == 0


def test_without_evict_own_a_prefix_at_its_cap_is_refused():
    """For work done for a caller (a dial-back check): the oldest is nearly done."""
    slots: Slots[str] = Slots(max_total=8, max_per_prefix=2, evict_own=False)
    slots.take("a1", "10.0.0.1")
    slots.take("a2", "10.0.0.2")
    assert slots.take("a3", "10.0.0.3") == (False, [])
    assert slots.statistics().refused == 1 and slots.take("b1", "10.0.1.1") == (True, [])


def test_a_full_table_gives_a_newcomer_the_oldest_slot_of_the_busiest_prefix():
    slots: Slots[str] = Slots(max_total=4, max_per_prefix=4)
    for name in ("a1", "a2", "a3"):
        slots.take(name, "10.0.1.1")
    slots.take("b1", "10.0.2.1")
    assert slots.take("c1", "10.0.3.1") == (True, ["a1"])
    # 10.0.1.0/24 (2 held) is still the busiest: one more from it goes over nobody's share ...
    assert slots.take("a4", "10.0.1.1") == (False, [])
    # ... and one from 10.0.2.0/24 (1 held) takes 10.0.1.0/24's oldest.
    assert slots.take("b2", "10.0.2.1") == (True, ["a2"])
    assert slots.statistics() == SlotStatistics(held=4, prefixes=3, refused=1, evicted=2)


def test_when_every_prefix_holds_one_a_new_prefix_takes_the_oldest_slot():
    slots: Slots[str] = Slots(max_total=3, max_per_prefix=3)
    for n in (1, 2, 3):
        slots.take(f"p{n}", f"10.0.{n}.1")
    assert slots.take("new", "10.0.9.1") == (True, ["p1"])
    assert slots.take("p2-again", "10.0.2.1") == (False, [])  # holds one, as does everyone


def test_a_released_slot_is_free_again_and_releasing_twice_is_harmless():
    slots: Slots[str] = Slots(max_total=1, max_per_prefix=1)
    slots.take("a", "10.0.0.1")
    slots.release("a")
    slots.release("a")
    assert len(slots) == 0 and slots.statistics().prefixes == 0
    assert slots.take("b", "10.0.1.1") == (True, [])


# -- the accept-rate budget -------------------------------------------------------------------


def test_a_prefix_gets_its_burst_at_once_then_its_rate():
    budget = AcceptBudget(rate=2.0, burst=4)
    assert [budget.allow("10.0.0.1", now=0.0) for _ in range(5)] == [True] * 4 + [False]
    assert budget.allow("10.0.0.2", now=0.1) is False  # the same /24: the same bucket
    assert budget.allow("10.0.0.1", now=0.5) is True  # 2 a second: one more after 0.5 s
    assert budget.allow("10.0.0.1", now=0.5) is False
    assert [budget.allow("10.0.0.1", now=100.0) for _ in range(5)] == [True] * 4 + [False]
    assert budget.statistics().over_budget == 4


def test_one_prefix_over_its_budget_costs_another_nothing():
    budget = AcceptBudget(rate=1.0, burst=2)
    for n in range(3000):  # a flood at 3,000 a second from one /24
        budget.allow(f"198.51.100.{n % 250}", now=n / 3000)
    assert budget.statistics().over_budget == 2998  # all but the burst: < 1 token refilled
    assert budget.allow("203.0.113.5", now=1.0) and budget.allow("203.0.113.5", now=1.0)
    assert budget.allow("2001:db8::1", now=1.0)


def test_the_budget_forgets_the_prefix_seen_least_recently_past_its_table():
    """Its memory is bounded; a forgotten prefix starts with a full bucket again."""
    budget = AcceptBudget(rate=1.0, burst=1, max_prefixes=2)
    assert budget.allow("10.0.1.1", now=0.0) and not budget.allow("10.0.1.1", now=0.0)
    budget.allow("10.0.2.1", now=0.0)
    budget.allow("10.0.3.1", now=0.0)  # 10.0.1.0/24 is forgotten
    assert budget.statistics().prefixes == 2
    assert budget.allow("10.0.1.1", now=0.0)


def test_a_clock_that_goes_back_adds_no_tokens():
    budget = AcceptBudget(rate=1.0, burst=1)
    assert budget.allow("10.0.0.1", now=10.0)
    assert not budget.allow("10.0.0.1", now=5.0)
    assert not budget.allow("10.0.0.1", now=10.5)


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        ({"max_total": 4, "max_per_prefix": 5}, "max_per_prefix=5"),
        ({"max_per_prefix": 0}, "max_per_prefix=0"),
        ({"accept_rate": 0}, "accept_rate=0"),
        ({"accept_burst": 0}, "accept_burst=0"),
    ],
)
def test_limits_that_cannot_work_are_refused_with_their_value(limits, match):
    fields = {"max_total": 8, "max_per_prefix": 2, "accept_rate": 1.0, "accept_burst": 1}
    with pytest.raises(ValueError, match=match):
        ListenerLimits(**{**fields, **limits})
