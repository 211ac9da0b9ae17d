"""megarl.parallel.fast_exit.exit_process does the interpreter's exit steps before os._exit: a
non-daemon thread finishes, an idle thread pool's workers are told to stop (as Inductor's compile
pool is, once vLLM compiles on CPU), atexit handlers run, buffered output is written, the code
is kept."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

PROBE = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from megarl.parallel.fast_exit import exit_process

pool = ThreadPoolExecutor(2)  # never shut down: idle workers waiting for work
pool.submit(time.sleep, 0).result()

def late():
    time.sleep(0.3)
    sys.stdout.write("thread done\\n")

threading.Thread(target=late).start()
atexit.register(lambda: sys.stdout.write("atexit ran\\n"))
sys.stdout.write("buffered, no newline flush")
exit_process(int(sys.argv[1]))
"""


def test_exit_process_finishes_threads_runs_atexit_and_flushes():
    for code in (0, 3):
        done = subprocess.run(
            [sys.executable, "-c", PROBE, str(code)],
            cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == code, done.stderr
        assert done.stdout.startswith("buffered, no newline flush"), done.stdout
        assert done.stdout.index("thread done") < done.stdout.index("atexit ran"), done.stdout
