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

from megarl.parallel.emulation import enable_cpu_emulation
from megarl.parallel.layout import ParallelLayout
from megarl.parallel.network import set_gloo_socket_ifname

DEFAULT_TIMEOUT_MINUTES = 180
"""Default collective timeout (3 h). It bounds how long a rank waits in a collective for its
peers; a distributed-checkpoint save of a large model (tens of GB per rank to shared storage,
the other ranks waiting in its closing collectives) can outlast PyTorch's 30 minutes, and the
NCCL watchdog would then kill a healthy job mid-save. The price: a real hang is reported later."""

TIMEOUT_ENV = "MEGARL_DIST_TIMEOUT_MINUTES"


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
) -> LaunchEnv:
    """Start the default process group and Megatron's parallel state (idempotent for the PG).

    ``timeout_minutes`` None: :func:`process_group_timeout_minutes` (for both).

    Raises ``ValueError`` naming the sizes when the world is not divisible by TP×PP×CP or by
    the expert grid ETP×EP×PP.
    """
    sizes = sizes or ParallelLayout()
    if timeout_minutes is None:
        timeout_minutes = process_group_timeout_minutes()
    launch = read_launch_env()
    sizes.data_parallel_size(launch.world_size)  # raises naming the sizes
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    else:
        enable_cpu_emulation()
    start_process_group(launch, timeout_minutes)
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor_model_parallel_size,
        pipeline_model_parallel_size=sizes.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=sizes.virtual_pipeline_model_parallel_size,
        context_parallel_size=sizes.context_parallel_size,
        expert_model_parallel_size=sizes.expert_model_parallel_size,
        expert_tensor_parallel_size=sizes.etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    connect_groups()
    return launch


GROUPS = (
    "get_model_parallel_group", "get_tensor_model_parallel_group",
    "get_pipeline_model_parallel_group", "get_data_parallel_group",
    "get_context_parallel_group", "get_embedding_group", "get_expert_model_parallel_group",
    "get_expert_tensor_parallel_group", "get_expert_data_parallel_group",
)  # fmt: skip
"""Megatron's groups :func:`connect_groups` connects, in this order on every rank: those megarl's
passes use (the position-embedding group serves learned absolute positions, which no model
here has; a dense model's expert groups are connected too, a few NCCL buffers per GPU)."""


def connect_groups() -> int:
    """One all-reduce of one element on each of this rank's Megatron groups (:data:`GROUPS`, a
    group that this rank is not in skipped); returns how many.

    NCCL creates a group's communicator at its first collective and allocates its buffers outside
    PyTorch's caching allocator; a group first used after a phase that left the cache holding
    the GPU fails there ("Failed to CUDA calloc async 4 bytes": an H100, 2026-11-27, the first
    gradient-norm all-reduce after a generation phase). Connecting every group at set-up, while
    the GPU is empty, avoids that. Every rank walks the same kinds in the same order and each
    kind's groups are disjoint, so the collectives pair up. (Binding the default group to a
    device, ``init_process_group(device_id=...)``, would connect them eagerly too, but then
    creating a gloo subgroup has the ranks outside it join an NCCL split that its members never
    join: Megatron's gloo data-parallel groups would hang.)"""
    from megatron.core import parallel_state

    one = torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")
    done: list[object] = []
    for name in GROUPS:
        try:
            groups = getattr(parallel_state, name)()
        except AssertionError:  # not made, or this rank is in none of them (embedding)
            continue
        for group in groups if isinstance(groups, list) else [groups]:
            if group is not None and all(group is not d for d in done):
                dist.all_reduce(one, group=group)
                done.append(group)
    return len(done)


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state and the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
