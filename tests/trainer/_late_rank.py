"""A training rank slow to start, as on a loaded machine (``MEGARL_TRAIN_MODULE`` of
tests/trainer/test_train_command.py): it marks itself started in ``$MEGARL_TEST_LATE_RANKS``,
waits until the torchrun that started it has died (at most 60 s) and one second more, and only
then runs as ``python -m megarl.trainer`` does, whose first lines arm its parent-death signal.
"""

import os
import time
from pathlib import Path

if __name__ == "__main__":
    parent = os.getppid()
    Path(os.environ["MEGARL_TEST_LATE_RANKS"], f"rank{os.environ['RANK']}.{os.getpid()}").touch()
    deadline = time.monotonic() + 60
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1.0)

    from megarl.parallel.fast_exit import exit_process
    from megarl.trainer import main

    exit_process(main())
