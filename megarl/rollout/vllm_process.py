"""vLLM inside a training rank: started in-process, sharing the trainer's process group, leaving
the trainer's state alone and nothing behind.

:func:`start_llm` pins vLLM's V1 model runner, makes CPU ranks run vLLM's compiled helpers
eagerly, keeps vLLM's CPU linear weights where a weight update can copy into them, gives vLLM's
IPC sockets a private directory removed at exit and unlinks the names of vLLM's CPU
shared-memory segments once they are mapped; its steps say why.
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
from megarl.parallel import fast_exit
from megarl.parallel.emulation import reassert_cpu_emulation
from megarl.parallel.init import read_launch_env, start_process_group

IPC_ENV = "VLLM_RPC_BASE_PATH"
SOCKET_PATH_MAX = 107
"""The longest AF_UNIX socket path Linux takes (``sun_path`` less its terminating NUL)."""
SOCKET_NAME_LEN = 37
"""What vLLM appends to its IPC directory: ``/`` and a UUID4."""
SHM_DIR = "/dev/shm"
"""Where Linux keeps POSIX shared memory (``shm_open`` names, leading slashes dropped)."""
CPU_LINEAR_CACHE_KEY = {"megarl_cpu_linear": "kept_weights"}
"""Added to vLLM's ``additional_config`` on CPU (:func:`_keep_cpu_linear_weights`)."""
SHM_EXISTS = "create shm in SHMManager failed. errno: 17"
"""vLLM's CPU collectives' error when a segment's name is taken (EEXIST)."""


def start_llm(model_path: str, kwargs: dict[str, Any]) -> Any:
    """``vllm.LLM(model_path, **kwargs)`` in this process, leaving the trainer's state alone.

    Model runner: vLLM 0.32 picks Model Runner V2 whenever ``VLLM_USE_V2_MODEL_RUNNER`` is unset
    and the host can run it (Triton with a driver, no unsupported feature). megarl's weight
    updates reach into the runner (``get_model()``, layerwise reload, the tied ``lm_head``
    re-pack) and are exercised on V1 only, so V1 is pinned unless the variable is set (``1``
    tries V2).

    Without CUDA and with ``enforce_eager``, ``torch.compiler.set_stance("force_eager")``: even
    then vLLM ``torch.compile``s three helpers (the TP embedding's vocabulary mask, the log-prob
    rank count, the top-k/top-p mask), and Inductor compiling each in every rank costs more than
    the tiny ops it speeds up; eager gives the same results (integer masks and counts). Without
    ``enforce_eager`` vLLM compiles its model with Inductor on CPU too (its start-up pays for
    it once per shape, cached under ``~/.cache/vllm``; generation of the tiny model's
    equal-work step 18 % faster, ``tools/bench_vs_trl.sh``).

    Without CUDA, vLLM's unquantized linears keep their weights (:func:`_keep_cpu_linear_weights`).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
    os.environ.setdefault(MODEL_RUNNER_ENV, "0")  # V1 runner unless asked (see the docstring)
    if not torch.cuda.is_available() and kwargs.get("enforce_eager", True):
        torch.compiler.set_stance("force_eager")  # (see the docstring)
    if not torch.cuda.is_available():
        _keep_cpu_linear_weights()
        # a compiled graph calls the linears it was traced with: a key of its cache (vLLM
        # hashes additional_config), so graphs cached with vLLM's packed linears never load
        kwargs = {**kwargs, "additional_config": {**kwargs.get("additional_config", {}),
                                                  **CPU_LINEAR_CACHE_KEY}}  # fmt: skip
    _quiet_expected_vllm_warnings()
    _private_ipc_directory()
    _shared_memory_names_per_launch()
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
                f"vLLM's CPU shared memory {SHM_DIR}/*cpushm_* is taken: another vLLM of this "
                "launch is starting, or one was killed while starting (remove those files if "
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
    """This rank's own shared-memory segments of vLLM's CPU collectives (TP > 1), by the names
    vLLM gave them, whether or not they still exist."""
    from vllm.distributed import parallel_state

    paths = []
    for ref in list(parallel_state._groups.values()):  # every GroupCoordinator (weak refs)
        comm = getattr(ref(), "device_communicator", None)
        name = getattr(getattr(comm, "dist_module", None), "group_name", None)
        if name is not None:  # a CPU communicator on shared memory
            paths.append(Path(SHM_DIR) / f"{name}_{comm.rank}".lstrip("/"))
    return paths


def unlink_cpu_shared_memory() -> None:
    """Remove the names of this rank's segments; call it once every rank of the group has
    mapped them (:func:`start_llm` does, once the engine is up).

    vLLM names them ``/dev/shm/<ident>-<group>-[<ranks>]-cpushm_<rank>`` with ``<ident>`` from
    the init method (``env://`` under the external launcher: the same for every run on a
    machine; megarl adds the launch's port, :func:`_shared_memory_names_per_launch`), creates
    them exclusively and unlinks them only in a C++ destructor that a fast exit
    skips, so a leftover name would make the next run fail (:data:`SHM_EXISTS`). The mappings
    live on after the unlink, and the destructor ignores the missing name.
    """
    for path in cpu_shared_memory():
        path.unlink(missing_ok=True)


def _keep_cpu_linear_weights() -> None:
    """vLLM's unquantized 2-D linears (and the LM head) on CPU multiply by their own weight with
    ``torch.nn.functional.linear`` instead of a packed copy.

    vLLM 0.32's CPU loader hands each such layer's weight to oneDNN (``create_onednn_mm``: a
    reordered copy, the weight itself emptied) or, for small bf16 weights on AMX, to a packed
    kernel. Every weight update must then reload layer by layer and repack: 60 ms of a 3.4 MB
    model's sync, 30 ms without the packing, 6 ms as a copy into the kept weights
    (:meth:`megarl.rollout.vllm_engine.VLLMEngine.begin_weight_update`); the equal-work step's
    ``update_weights`` 80-88 -> 24 ms. Generation is not slower (the tiny model's 16 x 32
    tokens, one thread: eager 415 against 444 ms; compiled 265-383 against 315-351 ms, this
    machine's noise), and the products are torch's, as the trainer's. Other weights (3-D MoE
    experts, convolutions) keep vLLM's dispatch.
    """
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "megarl_keeps_weights", False):
        return

    def keep_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            dispatch(layer, remove_weight)
        else:
            layer.cpu_linear = torch.nn.functional.linear

    keep_weight.megarl_keeps_weights = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = keep_weight


def _shared_memory_names_per_launch() -> None:
    """Put the launch's rendezvous port (``MASTER_PORT``) into the names of vLLM's CPU
    shared-memory segments.

    vLLM derives them from the init method, ``env://`` for every launch on a machine, so two
    launches starting vLLM TP > 1 at the same moment (the suite's two lanes) collide
    (:data:`SHM_EXISTS`) in the seconds before :func:`start_llm` unlinks the names. No two live
    launches on one machine share a ``MASTER_PORT``, and every rank of a launch has the same.
    """
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm.make_group_name, "megarl_per_launch", False):
        return
    make_group_name = shm.make_group_name

    def per_launch(communicator: Any) -> str:
        return shm_name_for_launch(make_group_name(communicator), os.environ.get("MASTER_PORT"))

    per_launch.megarl_per_launch = True  # type: ignore[attr-defined]
    shm.make_group_name = staticmethod(per_launch)


def shm_name_for_launch(name: str, port: str | None) -> str:
    """vLLM's ``<ident>-<group>-[<ranks>]-cpushm`` as ``<ident>-<group>-[<ranks>]-<port>-cpushm``
    (unchanged without a port)."""
    suffix = "-cpushm"
    if not port or not name.endswith(suffix):
        return name
    return f"{name.removesuffix(suffix)}-{port}{suffix}"


def _private_ipc_directory() -> None:
    """Point vLLM's IPC socket files at a directory of this process's, removed at exit; a
    directory the user set (``VLLM_RPC_BASE_PATH``) is left alone.

    vLLM's shared-memory broadcast queues bind ZeroMQ ``ipc://`` sockets, files under that
    directory (default: the temporary directory), and leave them behind when the process ends
    without closing them, as every rank does (torchrun's kill, or
    :func:`megarl.parallel.fast_exit.exit_process`, which runs the ``atexit`` handlers). The
    private directory goes in ``/tmp`` where the temporary directory is too deep for a socket
    path (``SOCKET_PATH_MAX``: zmq refuses to bind a longer one).
    """
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
    variables if needed, as the trainer does (:func:`megarl.parallel.init.start_process_group`),
    before vLLM can: vLLM would size it as one TP group, wrong when rollout DP > 1.

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

    original, collect = core_module.cleanup_dist_env_and_memory, gc.collect
    core_module.cleanup_dist_env_and_memory = release_model_parallel_groups
    if fast_exit.exiting:  # the process ends next: vLLM's two full collections (1.5 s) free
        gc.collect = lambda *args, **kwargs: 0  # nothing that matters
    try:
        core.shutdown()
    finally:
        core_module.cleanup_dist_env_and_memory, gc.collect = original, collect


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
