"""The whole test suite as two pytest sessions at once, one per half of ``tests/`` (``make test``).

On 2 cores one session leaves a core idle about a third of the time: a launch waits for
imports, vLLM's start-up, scorers that sleep, Slurm's scheduler, a checkpoint's writes (measured:
57.6 CPU-minutes in 41.6 minutes at c0c2fa7). Two sessions fill those gaps. The split is by
directory, so that each session-scoped fixture (the world-size launches of ``tests/models``, the
Slurm cluster of ``tests/launch``) stays in one session; its halves took 1244 s and 1228 s of
test time at c0c2fa7, 1248 s and 1173 s at 3bb3d15 (``tests/planner``, about 36 s alone, then
moved to lane 2):

- lane 1: ``tests/trainer``, ``tests/config``, ``tests/tracking``, ``tests/reward``, its output
  on the console as it runs;
- lane 2: every other test (a new directory lands here), its output kept in a file and printed
  once both lanes are done, without pytest's cache (lane 1 keeps it).

Each lane is an ordinary pytest session: rerun one alone with the paths below. ``PYTEST_ADDOPTS``
and any arguments reach both. Exit status: 0 when both pass, else lane 1's failure or lane 2's
(5, no test collected, counts as a failure).

    .venv/bin/python tools/run_tests.py [pytest options for both lanes]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LANE_1 = ("tests/trainer", "tests/config", "tests/tracking", "tests/reward")


DURATIONS = 20
"""Each lane ends with its slowest tests (setup, call, teardown each), so that a CI log says
where the suite's time goes when a new test must be paid for."""


def _pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-ra", f"--durations={DURATIONS}", *args]


def main(argv: list[str]) -> int:
    start = time.monotonic()
    lane_2_args = [*(f"--ignore={d}" for d in LANE_1), "-p", "no:cacheprovider", "tests", *argv]
    # The two lanes share the cores: one torch thread per process, so a run's ranks do not take
    # every core of a machine the other lane is using (`megarl train` would give a CPU rank
    # alone all of them). A value of the caller's wins.
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    with tempfile.TemporaryFile("w+") as log:
        lane_2 = subprocess.Popen(_pytest(*lane_2_args), cwd=REPO, env=env, stdout=log, stderr=log)
        lane_1 = subprocess.Popen(_pytest(*LANE_1, *argv), cwd=REPO, env=env)

        def forward(signum, _frame):
            for lane in (lane_1, lane_2):
                lane.send_signal(signum)

        previous = signal.signal(signal.SIGTERM, forward)
        try:
            code_1 = lane_1.wait()
            code_2 = lane_2.wait()
        except KeyboardInterrupt:  # the terminal sent SIGINT to both lanes as well
            lane_1.wait()
            lane_2.wait()
            return 130
        finally:
            signal.signal(signal.SIGTERM, previous)
        log.seek(0)
        print(f"\n---- lane 2: tests/ except {', '.join(LANE_1)} ----", flush=True)
        sys.stdout.write(log.read())
    minutes = (time.monotonic() - start) / 60
    print(f"\nmegarl tests: lane 1 exit {code_1}, lane 2 exit {code_2}; {minutes:.1f} min in all")
    return code_1 or code_2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
