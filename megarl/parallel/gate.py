"""The launch gate: ranks start while ``megarl train`` still checks the run, and wait here.

The launcher (:func:`megarl.commands.launch.run_torchrun` with a ``preflight``) creates a
temporary directory and names a file in it in ``MEGARL_LAUNCH_GATE``; each rank imports what
its set-up needs, marks itself waiting (``<gate>.waiting.rank<r>``) and polls for the file,
which the launcher creates once its checks have passed. On a problem the launcher kills
torchrun instead, and the ranks die with it (their parent-death signal), having written nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

GATE_ENV = "MEGARL_LAUNCH_GATE"
POLL_S = 0.02


def pass_gate(preload: Callable[[], object]) -> None:
    """In a rank: when the launcher checks the run meanwhile, run ``preload`` (the heavy
    imports) and wait until the checks have passed. Otherwise nothing."""
    gate = os.environ.pop(GATE_ENV, None)
    if not gate:
        return
    preload()
    open(f"{gate}.waiting.rank{os.environ.get('RANK', '0')}", "w").close()
    while not os.path.exists(gate):
        time.sleep(POLL_S)


def open_gate(gate: str) -> None:
    """In the launcher: let the waiting ranks through (the file appears whole, at once)."""
    with open(f"{gate}.tmp", "w"):
        pass
    os.replace(f"{gate}.tmp", gate)
