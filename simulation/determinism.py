"""Same seed, same run: trio's scheduling made deterministic while a simulation runs.

Trio leaves three choices to chance or to memory layout, and a simulation of hundreds of peers
on one virtual clock meets all three at every instant (many tasks wake at the same virtual
time):
- the order of the tasks that are ready at once: a random shuffle or reversal of each batch
  (`trio._core._run._r`). Trio's own switch for Hypothesis
  (`_ALLOW_DETERMINISTIC_SCHEDULING`) sorts each batch by the tasks' creation order before
  shuffling it with `_r`; we turn it on and seed `_r` from the scenario;
- the order of cancel scopes whose deadlines are equal: `id(scope)`, a memory address, broke
  the tie (`Deadlines.add`). We break it by the order the deadlines were set;
- Python's string hashing (the order of sets of peer ids): per process, fixed by
  `PYTHONHASHSEED`. `python -m simulation` sets it (`simulation.__main__`); runs within one
  process share it anyway.

The rest was already deterministic: the peers' keys, links and speeds come from the scenario's
`random.Random(seed)`, the DHT's refresh targets from the seeded module `random`, worker
threads run inline (`dataplane.simulated`) and the clock (`simulation.clock`) is virtual: it
jumps only when no task can run.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from heapq import heappush

from trio._core import _run


@contextlib.contextmanager
def deterministic_trio(seed: int) -> Iterator[None]:
    """While this lasts, `trio.run` schedules the same way for the same `seed` (module doc).
    Trio internals (0.35): the test that runs a scenario twice fails if they change."""
    order = itertools.count()
    real_add = _run.Deadlines.add

    def add(self: _run.Deadlines, deadline: float, cancel_scope: _run.CancelScope) -> None:
        heappush(self._heap, (deadline, next(order), cancel_scope))
        self._active += 1

    allowed = _run._ALLOW_DETERMINISTIC_SCHEDULING
    state = _run._r.getstate()
    _run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    _run._r.seed(seed)
    _run.Deadlines.add = add  # type: ignore[method-assign]
    try:
        yield
    finally:
        _run.Deadlines.add = real_add  # type: ignore[method-assign]
        _run._ALLOW_DETERMINISTIC_SCHEDULING = allowed  # type: ignore[misc]
        _run._r.setstate(state)
