"""The busiest node window by window (`simulation.windows`), and what each reply answered."""

from __future__ import annotations

import pytest

from peer.dht import protocol as p
from simulation.network import Traffic, served_as_what
from simulation.windows import WindowWatch


class Run:
    """A run's traffic as the watch reads it, fed by hand."""

    def __init__(self) -> None:
        self.traffic = Traffic()
        self.measuring = False
        self.servers = 4

    def serve(self, node: str, what: str, size: int) -> None:
        self.traffic.served[node] += size  # type: ignore[index]
        self.traffic.served_as[node, what] += size  # type: ignore[index]

    def watch(self) -> WindowWatch:
        return WindowWatch(lambda: self.traffic, lambda: self.servers, lambda: self.measuring)


def test_the_window_whose_busiest_node_sent_most_is_kept_with_what_it_answered():
    run = Run()
    watch = run.watch()
    run.serve("a", "get progress", 10_000)  # the warm-up: no window
    watch.on_jump(10.0)
    run.measuring, run.traffic = True, Traffic()  # measuring starts with a new Traffic
    watch.on_jump(20.0)
    run.serve("a", "get progress", 300)
    run.serve("b", "get progress", 600)
    watch.on_jump(49.0)  # not yet 30 s
    watch.on_jump(50.0)  # window 20-50: b sent 20 bytes/s
    run.serve("a", "get progress", 300)
    run.serve("c", "get avg", 2_400)  # a gathering's ticket reads at one holder
    run.serve("c", "get progress", 600)
    watch.on_jump(80.0)  # window 50-80: c sent 100 bytes/s
    run.serve("b", "get progress", 900)
    watch.on_jump(110.0)  # window 80-110: b at 30 bytes/s, below c's
    window = watch.busiest
    assert window is not None
    assert (window.start, window.end) == (50.0, 80.0)
    assert window.busiest == pytest.approx(100.0)
    assert window.mean_server == pytest.approx((300 + 3_000) / 30 / 4)  # 4 servers alive
    assert window.ratio == pytest.approx(100 / 27.5)
    assert window.what == (("get avg", 0.8), ("get progress", 0.2))


def test_no_window_before_measuring_nor_one_cut_short_by_the_end():
    run = Run()
    watch = run.watch()
    run.serve("a", "find_node", 900)
    watch.on_jump(100.0)
    assert watch.busiest is None  # the warm-up
    run.measuring = True
    watch.on_jump(100.0)  # the first window starts
    run.serve("a", "find_node", 900)
    watch.on_jump(129.0)
    assert watch.busiest is None  # 29 s: no whole window yet
    run.measuring = False  # the run ended (`Collaboration.ended`)
    watch.on_jump(200.0)
    assert watch.busiest is None  # the window it cut short is no window


def test_a_reply_is_counted_as_its_method_and_its_key_s_family():
    progress = p.Get(key="sim/progress/6#spread/6/17")
    assert served_as_what("get", progress) == "get progress"
    assert served_as_what("get", p.Get(key="sim/progress")) == "get progress"
    assert served_as_what("store", p.Get(key="sim/avg/f00/1800#spread/1/0")) == "store avg"
    assert served_as_what("find_node", p.FindNode(target=bytes(32))) == "find_node"
