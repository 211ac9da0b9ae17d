"""Process-group and Megatron ``parallel_state`` initialisation under torchrun or Slurm.

One process per device; rank, world and master come from torchrun's variables or, when those
are absent, Slurm's. NCCL on GPU, gloo on CPU, where the emulation layer
(:mod:`megarl.parallel.emulation`) is switched on before Megatron is touched. The collective
timeout (:func:`process_group_timeout_minutes`: ``actor_rollout_ref.nccl_timeout``, else
``MEGARL_DIST_TIMEOUT_MINUTES``) applies to the default group and, through
``distributed_timeout_minutes``, to Megatron's.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.parallel.connect import connect_groups
from megarl.parallel.emulation import enable_cpu_emulation
from megarl.parallel.layout import ParallelLayout
from megarl.parallel.network import set_gloo_socket_ifname

DEFAULT_TIMEOUT_MINUTES = 180
"""Default collective timeout (3 h). It bounds how long a rank waits in a collective for its
peers; a distributed-checkpoint save of a large model (tens of GB per rank to shared storage,
the other ranks waiting in its closing collectives) can outlast PyTorch's 30 minutes, and the
NCCL watchdog would then kill a healthy job mid-save. The price: a real hang is reported later."""

TIMEOUT_ENV = "MEGARL_DIST_TIMEOUT_MINUTES"
MAX_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
"""Set to 1 for every rank (``megarl train``'s environment, :func:`init_distributed` before CUDA
starts) unless the user set it: Megatron's TP/SP communication overlap and the async
gradient all-reduce order rely on one hardware work queue (``tensor_parallel/layers.py``)."""


def process_group_timeout_minutes(nccl_timeout_s: float | None = None) -> float:
    """The collective timeout in minutes: ``nccl_timeout_s`` seconds when given (verl's
    ``actor_rollout_ref.nccl_timeout``), else ``$MEGARL_DIST_TIMEOUT_MINUTES`` (a positive
    integer), else the default."""
    if nccl_timeout_s is not None:
        if nccl_timeout_s <= 0:
            raise ValueError(f"nccl_timeout={nccl_timeout_s} must be a positive number of seconds")
        return nccl_timeout_s / 60
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_TIMEOUT_MINUTES
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} must be a positive number of minutes")
    return int(value)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, read from torchrun or Slurm variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _first_slurm_host(nodelist: str) -> str:
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.CalledProcessError):
        pass
    return nodelist.split(",")[0].split("[")[0]


def read_launch_env(env: dict[str, str] | None = None) -> LaunchEnv:
    """Read rank/world/master from torchrun's variables, else Slurm's, else a single process."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )
    if "SLURM_PROCID" in env:
        nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1"))
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env.get("SLURM_NTASKS", 1)),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(nodelist),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", 29500)))


def device() -> torch.device:
    """The device this rank computes on: its GPU, or the CPU under emulation."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def start_process_group(launch: LaunchEnv, timeout_minutes: float | None = None) -> None:
    """Create the default process group for ``launch`` unless one exists: NCCL on GPU, gloo on
    CPU; the rendezvous is ``MASTER_ADDR``/``MASTER_PORT``, set from ``launch`` when unset.
    ``timeout_minutes`` None: :func:`process_group_timeout_minutes`."""
    if dist.is_initialized():
        return
    if timeout_minutes is None:
        timeout_minutes = process_group_timeout_minutes()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if launch.world_size == 1 and "MASTER_PORT" not in os.environ:
        # One process, no launcher: an in-memory store, so no port to lose to another job
        # (the default 29500 is shared by every such process on the machine; issue 53).
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    os.environ.setdefault("MASTER_ADDR", launch.master_addr)
    os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    set_gloo_socket_ifname(os.environ["MASTER_ADDR"])  # multi-node only; see its module
    dist.init_process_group(
        backend=backend, rank=launch.rank, world_size=launch.world_size, timeout=timeout
    )


def init_distributed(
    sizes: ParallelLayout | None = None,
    *,
    seed: int = 1234,
    timeout_minutes: float | None = None,
    rollout_tp: int | None = None,
) -> LaunchEnv:
    """Start the default process group and Megatron's parallel state (idempotent for the PG),
    then create every NCCL communicator a step uses
    (:func:`~megarl.parallel.connect.connect_groups`; ``rollout_tp``: a colocated vLLM's TP
    size, for the weight sync's pipeline pairs).

    ``timeout_minutes`` None: :func:`process_group_timeout_minutes` (for both).

    Raises ``ValueError`` naming the sizes when the world is not divisible by TP×PP×CP or by
    the expert grid ETP×EP×PP.
    """
    sizes = sizes or ParallelLayout()
    if timeout_minutes is None:
        timeout_minutes = process_group_timeout_minutes()
    launch = read_launch_env()
    sizes.data_parallel_size(launch.world_size)  # raises naming the sizes
    # Before the first CUDA context: Megatron's TP/SP communication overlap relies on one
    # hardware queue (kernels start in launch order); the user's value wins.
    os.environ.setdefault(MAX_CONNECTIONS_ENV, "1")
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    else:
        enable_cpu_emulation()
    start_process_group(launch, timeout_minutes)
    from megatron.core import parallel_state, tensor_parallel

    _destroy_layout_groups()
    _PRISTINE.clear()
    _PRISTINE.update(_parallel_state())
    before = _registered_groups()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor_model_parallel_size,
        pipeline_model_parallel_size=sizes.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=sizes.virtual_pipeline_model_parallel_size,
        context_parallel_size=sizes.context_parallel_size,
        expert_model_parallel_size=sizes.expert_model_parallel_size,
        expert_tensor_parallel_size=sizes.etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    _LAYOUT_GROUPS[:] = _registered_groups() - before
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    connect_groups(rollout_tp)
    return launch


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state and the default process group."""
    _destroy_layout_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


_LAYOUT_GROUPS: list = []
"""The process groups :func:`init_distributed` made for the current layout (Megatron's)."""


def _registered_groups() -> set:
    """Every process group torch.distributed knows in this process."""
    return set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()


def _destroy_layout_groups() -> None:
    """Megatron's parallel state and the groups the layout made. Megatron's own teardown only
    drops its references (it destroys its gloo data-parallel groups alone), so a process that
    builds many layouts (the suite's test ranks) kept every group and its threads: ~50 gloo
    threads per layout of two ranks (issue 53). Other groups (vLLM's, a caller's) are kept."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    alive = _registered_groups()
    for group in _LAYOUT_GROUPS:
        if group in alive:
            dist.destroy_process_group(group)
    _LAYOUT_GROUPS.clear()


_PRISTINE: dict = {}
"""Megatron's ``parallel_state`` globals before :func:`init_distributed` initialised them."""


def _parallel_state() -> dict:
    """Every module-level variable of Megatron's ``parallel_state`` (its groups, ranks, sizes and
    buffers: what ``initialize_model_parallel`` sets)."""
    import types

    from megatron.core import parallel_state

    skip = (types.FunctionType, types.ModuleType, type)
    return {
        name: value
        for name, value in vars(parallel_state).items()
        if name.startswith("_") and not name.startswith("__") and not isinstance(value, skip)
    }


def _set_parallel_state(state: dict) -> None:
    from megatron.core import parallel_state

    for name, value in state.items():
        setattr(parallel_state, name, value)


@dataclass
class SecondLayout:
    """Megatron's parallel state of another layout over the same ranks (a frozen model that
    runs at a TP × PP of its own, as the distillation teacher): built once by
    :func:`second_layout`, entered around that model's building and passes (:meth:`entered`),
    its groups destroyed with the first layout's."""

    sizes: ParallelLayout
    state: dict

    def entered(self):
        """A context in which Megatron's parallel state is this layout's (the first's after)."""
        import contextlib

        @contextlib.contextmanager
        def swapped():
            first = _parallel_state()
            _set_parallel_state(self.state)
            try:
                yield self
            finally:
                self.state = _parallel_state()  # buffers it allocated stay its own
                _set_parallel_state(first)

        return swapped()


def second_layout(sizes: ParallelLayout, timeout_minutes: float | None = None) -> SecondLayout:
    """Megatron's parallel state for ``sizes`` beside the current layout's (every rank calls it,
    after :func:`init_distributed`; each group is created once). Raises ``ValueError`` naming
    the sizes when the world does not divide. Megatron-Core keeps one parallel state per
    process and its modules read it at run time, so the model of the second layout runs inside
    :meth:`SecondLayout.entered`; its process groups are its own, connected now
    (:func:`~megarl.parallel.connect.connect_groups`), and live until
    :func:`destroy_distributed`."""
    from megatron.core import parallel_state

    sizes.data_parallel_size(dist.get_world_size())  # raises naming the sizes
    if timeout_minutes is None:
        timeout_minutes = process_group_timeout_minutes()
    first = _parallel_state()
    _set_parallel_state(_PRISTINE)
    before = _registered_groups()
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tensor_model_parallel_size,
            pipeline_model_parallel_size=sizes.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=sizes.virtual_pipeline_model_parallel_size,
            context_parallel_size=sizes.context_parallel_size,
            distributed_timeout_minutes=timeout_minutes,
        )
        connect_groups()  # its NCCL communicators too, while the GPU is empty (issue 54)
        state = _parallel_state()
    finally:
        _LAYOUT_GROUPS.extend(_registered_groups() - before)
        _set_parallel_state(first)
    return SecondLayout(sizes, state)
