"""Stand-in for ``megarl.trainer`` honouring the stop file: a step every 0.3 s until STOP appears.

It reads the run directory from its own ``--config``/overrides as the trainer will, prints
``step N`` per step and, once ``<run dir>/STOP`` exists, ``stopping after step N`` and exit 0.
Gives up (exit 3) after 5 minutes.
"""

from __future__ import annotations

import os
import sys
import time

from megarl.config import load_config
from megarl.tracking import STOP_FILE, run_dir_of

if __name__ == "__main__":
    args = sys.argv[1:]
    config, overrides = args[args.index("--config") + 1], args[args.index("--config") + 2 :]
    stop = run_dir_of(load_config([config], overrides)) / STOP_FILE
    rank = os.environ["RANK"]
    for step in range(1, 1000):
        time.sleep(0.3)
        print(f"rank {rank} step {step}", flush=True)
        if stop.exists():
            print(f"rank {rank} stopping after step {step}", flush=True)
            sys.exit(0)
    sys.exit(3)
