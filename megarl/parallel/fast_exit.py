"""End a finished megarl process without the interpreter's teardown.

Python's finalization (freeing every module of torch, Megatron, transformers and vLLM, destroying
the process groups' C++ objects) costs each rank and the launcher seconds on every launch.
:func:`exit_process` does what the interpreter does first (join the non-daemon threads, run the
``atexit`` handlers, multiprocessing's finalizers among them, flush the standard streams) and
then ends the process with ``os._exit``. Only for a process's last statement
(``if __name__ == "__main__":``), never where a caller goes on afterwards.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

exiting = False
"""True once :func:`exit_process` runs the ``atexit`` handlers: a handler may then skip work
that only matters to a process going on (freeing memory)."""


def exit_process(code: int | None) -> NoReturn:
    """Exit with ``code`` (None: 0) as described in the module docstring."""
    global exiting
    # The interpreter's first exit step: threading's own exit hooks (which tell the workers of
    # every concurrent.futures pool to stop; Inductor's compile pool is one), then the join of
    # every non-daemon thread. Joining without the hooks waits on those workers for ever.
    threading._shutdown()
    exiting = True
    atexit._run_exitfuncs()  # the interpreter's own exit step, run here
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to write
            pass
    os._exit(code or 0)
