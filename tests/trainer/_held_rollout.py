"""A rank that runs as ``python -m megarl.trainer`` does (``MEGARL_TRAIN_MODULE`` of the fully
async fault tests), with one hold on the rollout side: while ``$MEGARL_TEST_HOLD`` exists, each
time a weight update has been loaded between two tokens of a response that is not finished
(:meth:`megarl.rollout.partial.Streamer.interrupt` leaves it interrupted, to continue on the new
weights), the rank touches ``<hold>.reached`` and waits until the file is gone (at most 120 s)
before sending the responses on. A test signals there: during an interrupted-and-continuing
generation, the moment issue 55's fault line names. Training ranks never call ``interrupt``.

``$MEGARL_TEST_ROLLOUT_STEP_S`` (seconds, default 0) is added to each of the rollout rank's
engine steps: the rollout becomes the bottleneck, as on a long-tail task, so a sync finds
responses in flight (on the tiny task the rollout is otherwise done with its window's budget
before the trainer's K updates are).
"""

import os
import time
from pathlib import Path


def _hold_after_interrupts() -> None:
    from megarl.rollout.partial import Streamer

    hold = Path(os.environ["MEGARL_TEST_HOLD"])
    interrupt = Streamer.interrupt

    def held(self, swap) -> None:
        def swap_then_hold() -> None:
            swap()
            continuing = [
                r for job in self._jobs for r in job.responses
                if r.finish_reason is None and r.tokens
            ]  # fmt: skip
            if continuing and hold.exists():
                Path(f"{hold}.reached").write_text(str(len(continuing)))
                deadline = time.monotonic() + 120
                while hold.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)

        interrupt(self, swap_then_hold)

    Streamer.interrupt = held
    delay = float(os.environ.get("MEGARL_TEST_ROLLOUT_STEP_S", "0"))
    step = Streamer.step

    def slowed(self, version: int) -> None:
        time.sleep(delay)
        step(self, version)

    if delay > 0:
        Streamer.step = slowed


if __name__ == "__main__":
    _hold_after_interrupts()

    from megarl.parallel.fast_exit import exit_process
    from megarl.trainer import main

    exit_process(main())
