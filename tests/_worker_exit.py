"""The end of a multi-rank test worker: leave without the interpreter's shutdown.

A worker has written its results by the time ``main()`` returns; tearing down torch, Megatron
and vLLM afterwards takes about a second per rank, and torchrun (so the test) waits for it. So
the worker leaves as the ranks of a real run do (:func:`megarl.parallel.fast_exit.exit_process`:
threads joined, atexit handlers run, then ``os._exit``). A worker that still has child processes
exits normally instead, so that they are shut down as usual and none is orphaned.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import psutil

from megarl.parallel.fast_exit import exit_process


def exit_now() -> NoReturn:
    if psutil.Process().children():
        sys.exit(0)
    exit_process(0)
