"""The task's learning-rate scheduler, if it has one: stepped with every step of the optimizer it
drives, so every peer holds the same learning rate at the same global step, and carried in the
training state.

A task opts in with `make_scheduler(optimizer) -> torch.optim.lr_scheduler.LRScheduler | None`
(DeDLOC: on the optimizer, one step per global step; DiLoCo: on the inner optimizer, one step
per inner step, H per outer step on every peer). A scheduler's state arrives from
other peers as JSON: it is loaded only if it has exactly the structure of ours (same keys, same
kinds of values, same list lengths), because `load_state_dict` writes whatever it is given into
the scheduler's attributes.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from peer.training.state import StateMismatch
from peer.training.task import Task


class Schedule:
    def __init__(self, task: Task, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.make = getattr(task, "make_scheduler", None)
        # The settings as the task made them, before a scheduler touched them (`replay`).
        self.initial = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = (
            self.make(optimizer) if self.make else None
        )

    def replay(self, epochs: int) -> None:
        """Our own schedule as of `epochs` scheduler steps, from the task's settings (after a
        state download: a donor's scheduler state is never loaded, since it sets the learning
        rate). A fresh scheduler stepped `epochs` times: about a microsecond a step."""
        if self.make is None:
            return
        for group, initial in zip(self.optimizer.param_groups, self.initial, strict=True):
            params = group["params"]
            group.clear()
            group.update(copy.deepcopy(initial), params=params)
        self.scheduler = self.make(self.optimizer)
        for _ in range(epochs):
            self.step()

    def step(self) -> None:
        if self.scheduler is None:
            return
        with warnings.catch_warnings():
            # The schedule follows the global step, also on a peer whose (inner) optimizer
            # took no step of its own since the last one: torch's order warning does not apply.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()

    def state(self) -> dict[str, Any] | None:
        return copy.deepcopy(self.scheduler.state_dict()) if self.scheduler else None

    def check(self, state: Any) -> None:
        """Raise StateMismatch unless `state` could be ours (call before changing anything)."""
        ours = self.state()
        if ours is None or state is None:
            if ours is not state:
                have = "a scheduler" if ours is not None else "no scheduler"
                raise StateMismatch(
                    f"scheduler state {'missing' if state is None else 'extra'}: "
                    f"this task has {have}"
                )
            return
        problem = _structure_problem(ours, state, "scheduler")
        if problem:
            raise StateMismatch(problem)

    def load(self, state: dict[str, Any] | None) -> None:
        """Load a state that passed `check`."""
        if self.scheduler is not None and state is not None:
            self.scheduler.load_state_dict(copy.deepcopy(state))


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list | tuple):  # a tuple comes back from JSON as a list
        return "list"
    return type(value).__name__


def _structure_problem(ours: Any, theirs: Any, where: str) -> str | None:
    if _kind(ours) != _kind(theirs):
        return f"{where} is {_kind(theirs)}, expected {_kind(ours)}"
    if isinstance(ours, dict):
        if set(ours) != set(theirs):
            return f"{where} has keys {sorted(map(str, theirs))}, expected {sorted(ours)}"
        for key in ours:
            if problem := _structure_problem(ours[key], theirs[key], f"{where}.{key}"):
                return problem
    elif isinstance(ours, list | tuple):
        if len(ours) != len(theirs):
            return f"{where} has {len(theirs)} entries, expected {len(ours)}"
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if problem := _structure_problem(a, b, f"{where}[{index}]"):
                return problem
    return None
