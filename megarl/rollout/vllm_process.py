"""vLLM inside a training rank: started in-process, sharing the trainer's process group, leaving
the trainer's state alone and nothing behind.

Model runner: vLLM 0.32 picks Model Runner V2 whenever ``VLLM_USE_V2_MODEL_RUNNER`` is unset,
Triton has an active driver (any CUDA host) and the config has no V2-unsupported feature
(``VllmConfig.use_v2_model_runner``). megarl's weight updates reach into the runner
(``model_runner.get_model()``, layerwise reload, the tied ``lm_head`` re-pack) and have only been
exercised on the V1 runner, so the engine pins V1 (``VLLM_USE_V2_MODEL_RUNNER=0``) unless the
variable is already set: ``VLLM_USE_V2_MODEL_RUNNER=1`` in the job's environment tries V2.

Compilation on CPU: with ``enforce_eager`` vLLM compiles no model graph, but three helpers are
``torch.compile``-decorated regardless (the TP embedding's vocabulary mask, the log-prob rank
count, the top-k/top-p mask) and Inductor compiles each on its first call in every rank: a
2-step quickstart took 67 s with them and 50 s without, on two cores, for ops over a few hundred
tokens. Without CUDA the engine therefore sets
``torch.compiler.set_stance("force_eager")`` before starting vLLM: those helpers run eagerly
(integer masks and counts: the same results), and nothing else in a CPU rank compiles
(:mod:`megarl.parallel.import_hooks`). On GPU nothing changes.

IPC sockets: vLLM's shared-memory broadcast queues bind ZeroMQ ``ipc://`` sockets, files named by
a random UUID under ``VLLM_RPC_BASE_PATH`` (default: the temporary directory), and leave them
there when the process ends without closing them, as every rank does (torchrun's kill, or
:func:`megarl.parallel.fast_exit.exit_process`): measured 4 files in ``/tmp`` per engine start.
Unless the variable is set, each rank points it at a private directory of its own that is
removed at exit (atexit; ``exit_process`` runs the handlers): in the temporary directory (under
``megarl train``, the launch's own), or in ``/tmp`` where that is too deep for a socket path
(Linux takes at most 107 bytes; zmq refuses to bind a longer one).

Shared memory on CPU: vLLM's CPU collectives (TP > 1) map one POSIX shared-memory segment per
rank, ``/dev/shm/<ident>-<group>-[<ranks>]-cpushm_<rank>``, where ``<ident>`` comes from the
init method, ``env://`` under the external launcher, so every run on a machine uses the same
names; they are created exclusively and unlinked only by a C++ destructor that a fast exit
skips, so a finished run left them behind and the next run on the machine failed ("create shm in
SHMManager failed. errno: 17"). Once the engine is up every rank of the group has mapped every
segment, so each rank unlinks its own name there (the mappings live on; the destructor's own
unlink then finds nothing, which it ignores): nothing is left even by a killed run. A segment
left by a run killed while its engine started is named in a one-line error.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.config.moe_checks import MODEL_RUNNER_ENV  # megarl sets it to 0 (V1) when unset
from megarl.parallel.emulation import reassert_cpu_emulation
from megarl.parallel.init import read_launch_env, start_process_group

IPC_ENV = "VLLM_RPC_BASE_PATH"
SOCKET_PATH_MAX = 107
"""The longest AF_UNIX socket path Linux takes (``sun_path`` less its terminating NUL)."""
SOCKET_NAME_LEN = 37
"""What vLLM appends to its IPC directory: ``/`` and a UUID4."""
SHM_DIR = "/dev/shm"
"""Where Linux keeps POSIX shared memory (``shm_open`` names, leading slashes dropped)."""
SHM_EXISTS = "create shm in SHMManager failed. errno: 17"
"""vLLM's CPU collectives' error when a segment's name is taken (EEXIST)."""


def start_llm(model_path: str, kwargs: dict[str, Any]) -> Any:
    """``vllm.LLM(model_path, **kwargs)`` in this process, leaving the trainer's state alone."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
    os.environ.setdefault(MODEL_RUNNER_ENV, "0")  # V1 runner unless asked (module docstring)
    if not torch.cuda.is_available():
        torch.compiler.set_stance("force_eager")  # (module docstring)
    _quiet_expected_vllm_warnings()
    _private_ipc_directory()
    # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process;
    # training code sharing the process keeps the real one.
    set_num_threads = torch.set_num_threads
    try:
        with preserve_rng_state():  # importing vLLM already draws from Python's RNG
            from vllm import LLM

            llm = LLM(model_path, **kwargs)
    except RuntimeError as exc:
        if SHM_EXISTS in str(exc):
            raise RuntimeError(
                f"vLLM's CPU shared memory {SHM_DIR}/*cpushm_* is taken: another vLLM on this "
                "machine is starting, or one was killed while starting (remove those files if "
                "none is running)"
            ) from exc
        raise
    finally:
        torch.set_num_threads = set_num_threads
        reassert_cpu_emulation()  # vLLM's CPU worker installs its own CUDA stream stand-ins
    _keep_default_group_on_shutdown(llm)
    if not torch.cuda.is_available():
        unlink_cpu_shared_memory()
    return llm


def cpu_shared_memory() -> list[Path]:
    """This rank's own shared-memory segments of vLLM's CPU collectives (module docstring), by
    the names vLLM gave them, whether or not they still exist."""
    from vllm.distributed import parallel_state

    paths = []
    for ref in list(parallel_state._groups.values()):  # every GroupCoordinator (weak refs)
        comm = getattr(ref(), "device_communicator", None)
        name = getattr(getattr(comm, "dist_module", None), "group_name", None)
        if name is not None:  # a CPU communicator on shared memory
            paths.append(Path(SHM_DIR) / f"{name}_{comm.rank}".lstrip("/"))
    return paths


def unlink_cpu_shared_memory() -> None:
    """Remove the names of this rank's segments (module docstring)."""
    for path in cpu_shared_memory():
        path.unlink(missing_ok=True)


def _private_ipc_directory() -> None:
    """Point vLLM's IPC socket files at a directory of this process's, removed at exit (module
    docstring); a directory the user set is left alone."""
    if IPC_ENV in os.environ:
        return
    path = tempfile.mkdtemp(prefix="vllm-ipc-")
    if len(path) + SOCKET_NAME_LEN > SOCKET_PATH_MAX:  # a deep TMPDIR: zmq would refuse to bind
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix="megarl-vllm-ipc-", dir="/tmp")
    os.environ[IPC_ENV] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


# ---------------------------------------------------------------------- process-group plumbing


def ensure_process_group() -> bool:
    """True when running distributed; creates the default group from torchrun's (or Slurm's)
    variables if needed, as the trainer does (:func:`megarl.parallel.init.start_process_group`).

    vLLM's external launcher reads ``RANK``/``LOCAL_RANK`` from the environment; they are filled
    in from the existing group when it was created some other way.
    """
    if not dist.is_initialized():
        launch = read_launch_env()
        if launch.world_size == 1:
            return False
        start_process_group(launch)
    rank = dist.get_rank()
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    if "LOCAL_RANK" not in os.environ:
        local = torch.cuda.current_device() if torch.cuda.is_available() else rank
        os.environ["LOCAL_RANK"] = str(local)
    return True


def _keep_default_group_on_shutdown(llm: Any) -> None:
    """Swap vLLM's engine finalizer for one that spares the default process group.

    vLLM's in-process engine core tears down *all* of torch.distributed when it is shut down or
    garbage-collected (``cleanup_dist_env_and_memory`` destroys the default group), which would
    take the trainer's group with it.
    """
    client = llm.llm_engine.engine_core
    old = getattr(client, "_finalizer", None)
    if old is None or not old.detach():
        return
    client._megarl_finalizer = weakref.finalize(client, _shutdown_core, client.engine_core)


def _shutdown_core(core: Any) -> None:
    import vllm.v1.engine.core as core_module
    from vllm.distributed.parallel_state import destroy_model_parallel

    def release_model_parallel_groups() -> None:
        destroy_model_parallel()
        gc.collect()

    original = core_module.cleanup_dist_env_and_memory
    core_module.cleanup_dist_env_and_memory = release_model_parallel_groups
    try:
        core.shutdown()
    finally:
        core_module.cleanup_dist_env_and_memory = original


class _ExpectedWarnings(logging.Filter):
    """Drops two warnings that are expected here: the chat-template warm-up failing because the
    tokenizer is skipped, and rotary embeddings (no checkpoint tensors) "failing" to load on every
    weight update."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith("Chat template warmup failed"):
            return False
        return not (msg == "%s: Failed to load weights" and "Rotary" in str(record.args[0]))


def _quiet_expected_vllm_warnings() -> None:
    for name in ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ExpectedWarnings) for f in logger.filters):
            logger.addFilter(_ExpectedWarnings())


@contextlib.contextmanager
def preserve_rng_state() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's global RNGs afterwards: vLLM reseeds all of them at
    start-up and its CPU sampler draws from torch's on every step, which would otherwise shift
    the trainer's random streams (one stream on CPU emulation, where "cuda" is the CPU)."""
    import random

    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
