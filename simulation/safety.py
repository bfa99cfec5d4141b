"""The safety check of every simulated run: two peers that took the same step hold the same
parameters, at every moment of the run (not only at its end).

Every simulated worker reports each state it takes as a step, applied or downloaded
(`SimWorker.on_hold`), with the digest of its parameters. The first digest seen for a step is
the step's; any other, on any peer, at any time, is a violation: logged at once as an error,
kept in the report, and it fails the run (`python -m simulation` exits non-zero, the tests
assert none).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Violation:
    step: int
    peer: str
    digest: str
    at: float
    """Virtual seconds."""
    first_peer: str
    first_digest: str


@dataclass
class SafetyCheck:
    first: dict[int, tuple[str, str]] = field(default_factory=dict)
    """step -> (digest, peer): the first state anyone took as that step."""
    violations: list[Violation] = field(default_factory=list)
    taken_at: dict[int, float] = field(default_factory=dict)
    """step -> virtual seconds: when the first peer took it (the report's rounds)."""

    def held(self, step: int, peer: str, digest: str, at: float) -> None:
        self.taken_at.setdefault(step, at)
        first = self.first.setdefault(step, (digest, peer))
        if first[0] != digest:
            violation = Violation(step, peer, digest, at, first[1], first[0])
            self.violations.append(violation)
            log.error(
                "SAFETY VIOLATION at %.1fs: %s took step %d as %s, %s took it as %s",
                at, peer, step, digest[:12], first[1], first[0][:12],
            )  # fmt: skip
