"""Small C kernels for CPU hot loops: compiled on first use, loaded with ctypes, run on threads.

A kernel is one C file next to this module. `load(name)` compiles it with the system C compiler
(`$CC`, else `cc`/`gcc`) into `$MEGARL_CACHE_DIR/native` (default `~/.cache/megarl/native`),
named by a hash of the source, the compiler and the flags, so that an edited kernel is rebuilt
and concurrent ranks never load a half-written file (each builds into its own temporary name,
then renames). It returns None, after one warning, when there is no compiler, the build fails or
`MEGARL_NATIVE=0`: callers then use their torch implementation, which is also the one every
non-CPU device runs.

`run_split(function, n, threads)` calls `function(begin, end)` on `threads` contiguous parts of
range(n) at once: ctypes releases the GIL during the call, so parts run in parallel.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ("-O2", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off")
_libraries: dict[str, ctypes.CDLL | None] = {}
_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}
# A forked child inherits the pools but not their threads: work submitted there could wait
# forever (the executor may count the parent's idle threads as its own).
os.register_at_fork(after_in_child=_pools.clear)


def load(name: str) -> ctypes.CDLL | None:
    """The compiled library of `<name>.c` beside this module, or None if it cannot be had."""
    with _lock:
        if name not in _libraries:
            _libraries[name] = _build_and_load(name)
        return _libraries[name]


def _build_and_load(name: str) -> ctypes.CDLL | None:
    if os.environ.get("MEGARL_NATIVE", "1") == "0":
        return None
    source = Path(__file__).with_name(f"{name}.c")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: %s runs on its torch implementation", name)
        return None
    identity = [source.read_bytes(), compiler.encode(), " ".join(FLAGS).encode()]
    key = hashlib.sha256(b"\0".join([*identity, platform.machine().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("MEGARL_CACHE_DIR") or Path.home() / ".cache" / "megarl")
    library = cache / "native" / f"{name}-{key}.so"
    try:
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")
            os.close(fd)
            try:
                subprocess.run(
                    [compiler, *FLAGS, "-o", partial, str(source)],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                os.replace(partial, library)
            finally:
                if os.path.exists(partial):
                    os.unlink(partial)
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("building %s failed, using its torch implementation: %s", source, detail)
        return None


def run_split(function, n: int, threads: int) -> list:
    """[function(begin, end) for each of `threads` contiguous parts of range(n)], run at once."""
    threads = max(1, min(threads, n))
    bounds = [n * i // threads for i in range(threads + 1)]
    if threads == 1:
        return [function(0, n)]
    with _lock:
        pool = _pools.get(threads) or _pools.setdefault(threads, ThreadPoolExecutor(threads))
    futures = [pool.submit(function, lo, hi) for lo, hi in itertools.pairwise(bounds)]
    return [future.result() for future in futures]
