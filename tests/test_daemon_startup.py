"""What a peer daemon does before its event loop has work (`peer.daemon.load_workload`)."""

from __future__ import annotations

import subprocess
import sys

# In a fresh interpreter: another test may have imported the modules already.
WARMED = """
import sys
from peer.config import load_config
from peer.daemon import load_workload

assert "sympy" not in sys.modules
load_workload(load_config(env={}, overrides={}).config)
print("sympy" in sys.modules, "torch._dynamo" in sys.modules)
"""


def test_the_imports_of_the_first_optimizer_come_before_the_event_loop_has_work():
    """A fused AdamW's first construction imports ~820 modules (sympy among them), holding
    the GIL for long stretches: made in a thread beside the running node, they stalled its
    event loop 0.1-0.3 s at a time. `load_workload` makes them before the node starts."""
    done = subprocess.run(
        [sys.executable, "-c", WARMED], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
