"""One launch, two (or three) worlds: training ranks, rollout ranks and teacher ranks.

torchrun (or Slurm) starts ``W`` processes; the first ``train_size`` train, the last
``teacher_size`` (none unless on-policy distillation's vLLM teacher has a pool:
:mod:`.teacher`; several teachers, routed by ``teacher_key``, a block and a world each) serve
the teacher, and those between host the rollout engines (on several
nodes, whole nodes: torchrun numbers ranks node by node). Each
side gets its own default process group, so that Megatron-Core (which sizes every parallel group
from it) sees only the training ranks and vLLM's external launcher only the rollout ranks;
``RANK`` and ``WORLD_SIZE`` are rewritten to the side's numbering (the launch's are kept in
``MEGARL_LAUNCH_RANK`` / ``MEGARL_LAUNCH_WORLD_SIZE``; ``LOCAL_RANK``, which picks the GPU, is
left alone unless the node has fewer GPUs than processes: then the processes share them round
robin and ``LOCAL_RANK`` becomes the GPU's index, because vLLM's external launcher takes its
device from it and asserts ``local_rank < device_count``; on one GPU, 1 training + 1 rollout
process both use GPU 0, as ``tools/gpu_check.py``'s overlap section does). The two sides talk over plain ``ProcessGroup`` objects built on the launch's store
(:meth:`SplitWorld.group`), not registered with ``torch.distributed``: call their methods
(``broadcast``, ``send``, ...) directly, or the helpers here.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from megarl.parallel.emulation import enable_cpu_emulation
from megarl.parallel.init import LaunchEnv, process_group_timeout_minutes, read_launch_env
from megarl.parallel.network import set_gloo_socket_ifname

__all__ = [
    "Channels",
    "SplitWorld",
    "broadcast_object",
    "current",
    "device_count",
    "distinct_devices",
    "from_rank",
    "split_world",
]

Role = Literal["train", "rollout", "teacher"]
HOST = torch.device("cpu")
"""Where gloo's buckets live."""
EMULATED_DEVICES_ENV = "MEGARL_EMULATED_DEVICES"
"""CPU only: the number of devices the split launch maps ``LOCAL_RANK`` onto, as on a node with
that many GPUs (``tools/gpu_check.py --device cpu`` runs its overlap section with 1); unset: no
mapping on CPU."""


@dataclass
class Channels:
    """The groups between the first training rank (their rank 0) and the rollout ranks (rank 1
    onwards), None where this process is not a member."""

    control: Any
    """Commands, broadcast by the first training rank to every rollout rank."""
    replies: Any
    """Replies, broadcast by the first rollout rank to the first training rank, in order."""
    weights: Any
    """Weight buckets, broadcast by the first training rank to every rollout rank."""
    weights_device: torch.device = HOST
    """Where the buckets on ``weights`` live: this rank's GPU when ``weights`` is NCCL."""


@dataclass
class SplitWorld:
    """This process's place in a split launch (see the module docstring)."""

    role: Role
    rank: int
    """The launch's rank (0..world_size-1)."""
    world_size: int
    train_size: int
    store: dist.Store
    timeout: timedelta
    bridge: Any = None
    """Every process of the launch (a gloo ``ProcessGroup``)."""
    teacher_size: int = 0
    """The last ranks, which serve the distillation teachers (:mod:`.teacher`)."""
    teacher_sizes: tuple[int, ...] = ()
    """Each teacher's share of them, in order (a world of its own each); () is one teacher."""
    _groups: dict = field(default_factory=dict)

    @property
    def rollout_ranks(self) -> list[int]:
        return list(range(self.train_size, self.world_size - self.teacher_size))

    @property
    def teacher_ranks(self) -> list[int]:
        return list(range(self.world_size - self.teacher_size, self.world_size))

    def teacher_blocks(self) -> list[list[int]]:
        """Each teacher's ranks, in order (one block without ``teacher_sizes``)."""
        return _blocks(
            self.world_size - self.teacher_size, self.teacher_sizes or (self.teacher_size,)
        )

    @property
    def teacher_index(self) -> int | None:
        """Which teacher this rank serves (None on the other sides)."""
        for index, block in enumerate(self.teacher_blocks()):
            if self.rank in block:
                return index
        return None

    def control(self) -> Any:
        """The group the trainer drives the rollout engine over: the first training rank, then
        every rollout rank (None on the other training ranks)."""
        return self.group("control", [0, *self.rollout_ranks])

    def channels(self, *, nccl_weights: bool = False) -> Channels | None:
        """The trainer's three groups with the rollout ranks (created in this order by every
        member; each used by one thread of a process, so that none waits behind another); None
        on the training ranks after the first.

        ``nccl_weights`` (the same on every member): the weights' group is NCCL when every
        member has a GPU of its own (NCCL refuses two ranks on one device; the members compare
        theirs through the store, so they agree), its buckets on this rank's GPU; gloo and
        host memory otherwise. Only for a group whose members use it from one thread at a time,
        while no other NCCL work of theirs runs concurrently (NCCL's rule for several
        communicators): the rollout side receives at most one step off on its main thread,
        between two requests (:mod:`megarl.rollout.remote.serve`). A rollout rank builds its
        channels once vLLM holds its pool (both sides start meanwhile), so NCCL's buffers and one
        bucket at a time (``megarl plan``'s ``bucket received``) come from the GPU memory vLLM
        leaves (``rollout.gpu_memory_utilization``). A dead peer shows on the gloo groups first;
        one dying inside an NCCL transfer ends the rank when NCCL's watchdog times out."""
        if self.role == "train" and self.rank != 0:
            return None
        first = self.rollout_ranks[0]
        control = self.control()
        replies = self.group("replies", [0, first])
        members = [0, *self.rollout_ranks]
        if nccl_weights and self._gpus_of_their_own(members):
            weights = self.group("weights", members, backend="nccl")
            device = torch.device("cuda", torch.cuda.current_device())
            weights.broadcast([torch.zeros(1, device=device)], from_rank(0)).wait()  # connect now
            torch.cuda.synchronize(device)  # while the GPU has room (tests/parallel/test_nccl_gpu)
            return Channels(control, replies, weights, device)
        return Channels(control, replies, self.group("weights", members))

    def group(self, name: str, members: list[int], *, backend: str = "gloo") -> Any:
        """A group over the launch ranks ``members`` (in that order), gloo or NCCL (``backend``;
        on this process's current GPU); created by the members only (None elsewhere), once per
        name."""
        if self.rank not in members:
            return None
        if name not in self._groups:
            prefix = dist.PrefixStore(f"megarl/{name}", self.store)
            rank, size = members.index(self.rank), len(members)
            if backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                self._groups[name] = dist.ProcessGroupNCCL(prefix, rank, size, options)
            else:
                self._groups[name] = dist.ProcessGroupGloo(prefix, rank, size, self.timeout)
        return self._groups[name]

    def _gpus_of_their_own(self, members: list[int]) -> bool:
        """Whether every one of ``members`` has a GPU no other one has (False without CUDA);
        every member calls it, and all get the same answer."""
        mine = ""
        if torch.cuda.is_available():  # unique across machines (containers share hostnames)
            mine = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        store = dist.PrefixStore("megarl/devices", self.store)
        store.set(str(self.rank), mine)
        return distinct_devices([store.get(str(r)).decode() for r in members])


def _blocks(first: int, sizes) -> list[list[int]]:
    out, start = [], first
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def split_world(
    train_size: int,
    *,
    teacher_size: int = 0,
    teacher_sizes: tuple[int, ...] = (),
    timeout: timedelta | None = None,
) -> SplitWorld:
    """Split this launch into its first ``train_size`` ranks (training), its last
    ``teacher_size`` (teacher) and the rest (rollout), each side with its own default process
    group (NCCL on GPU for training, gloo otherwise); raises ``ValueError`` naming the sizes
    when the training side or both others would be empty. ``teacher_sizes`` (summing to
    ``teacher_size``): several teachers, each its own side of that many ranks, in order.
    ``timeout``: how long a collective waits for its peers (default
    :func:`process_group_timeout_minutes`).

    On several nodes ``GLOO_SOCKET_IFNAME`` is set first (unless the user set it), as the
    colocated launch does (:func:`megarl.parallel.network.set_gloo_socket_ifname`): the bridge
    and the rollout side are gloo groups across nodes, and gloo's own pick of an interface may be
    one the other nodes cannot reach (a hang at the first group). It reads the launch's
    ``WORLD_SIZE``, so it runs before the sides rewrite it."""
    launch = read_launch_env()
    set_gloo_socket_ifname(launch.master_addr)
    if (
        not 0 < train_size < launch.world_size
        or not 0 <= teacher_size <= launch.world_size - train_size
    ):
        raise ValueError(
            f"{train_size} training and {teacher_size} teacher ranks out of {launch.world_size}: "
            "training needs at least one rank, and rollout or the teacher another"
        )
    if teacher_sizes and (sum(teacher_sizes) != teacher_size or min(teacher_sizes) < 1):
        raise ValueError(
            f"teacher ranks {teacher_sizes} do not split the {teacher_size} teacher ranks"
        )
    timeout = timeout or timedelta(minutes=process_group_timeout_minutes())
    store = _launch_store(launch, timeout)
    first_teacher = launch.world_size - teacher_size
    role: Role = "train" if launch.rank < train_size else "rollout"
    start, end = (0, train_size) if role == "train" else (train_size, first_teacher)
    side = role
    if launch.rank >= first_teacher:
        role, side = "teacher", "teacher"
        for index, block in enumerate(_blocks(first_teacher, teacher_sizes or (teacher_size,))):
            if launch.rank in block:  # each teacher a world of its own (the first: "teacher")
                start, end = block[0], block[-1] + 1
                side = f"teacher{index}" if index else "teacher"
    sub_rank, sub_size = launch.rank - start, end - start
    on_gpu = torch.cuda.is_available()
    devices = device_count()
    if devices and launch.local_rank >= devices:  # more processes than GPUs: share them
        local = launch.local_rank % devices
        print(f"megarl: launch rank {launch.rank}: {devices} device(s) on this node for more "
              f"processes: LOCAL_RANK {launch.local_rank} -> {local} (shared)", flush=True)  # fmt: skip
        os.environ["LOCAL_RANK"] = str(local)
    if on_gpu:
        torch.cuda.set_device(launch.local_rank % devices)
    else:
        enable_cpu_emulation()
    os.environ["MEGARL_LAUNCH_RANK"] = str(launch.rank)
    os.environ["MEGARL_LAUNCH_WORLD_SIZE"] = str(launch.world_size)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(sub_rank), str(sub_size)
    dist.init_process_group(
        backend="nccl" if on_gpu and role == "train" else "gloo",
        store=dist.PrefixStore(f"megarl/{side}", store),
        rank=sub_rank,
        world_size=sub_size,
        timeout=timeout,
    )
    world = SplitWorld(role, launch.rank, launch.world_size, train_size, store, timeout,
                       teacher_size=teacher_size, teacher_sizes=tuple(teacher_sizes))  # fmt: skip
    world.bridge = world.group("bridge", list(range(launch.world_size)))
    global _CURRENT
    _CURRENT = world
    return world


def device_count() -> int:
    """The GPUs this process sees, or on CPU :data:`EMULATED_DEVICES_ENV` (0: not emulated)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return int(os.environ.get(EMULATED_DEVICES_ENV, "0"))


_CURRENT: SplitWorld | None = None


def current() -> SplitWorld | None:
    """This process's split launch (None: not split)."""
    return _CURRENT


def _launch_store(launch: LaunchEnv, timeout: timedelta) -> dist.Store:
    # Under torchrun its agent hosts the store at MASTER_ADDR:MASTER_PORT and every process is a
    # client; otherwise (Slurm) the launch's rank 0 hosts it.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(
        launch.master_addr,
        launch.master_port,
        launch.world_size,
        is_master=not agent and launch.rank == 0,
        timeout=timeout,
    )


def distinct_devices(devices: list[str]) -> bool:
    """Whether each of ``devices`` (GPU uuids; empty: no GPU) is a GPU and none is another's."""
    return all(devices) and len(set(devices)) == len(devices)


def from_rank(root: int) -> dist.BroadcastOptions:
    """Options of a broadcast from the group's rank ``root`` (for a group's own ``broadcast``)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return opts


def broadcast_object(group: Any, obj: Any, root: int) -> Any:
    """``obj`` of the group's rank ``root`` on every member (pickled; CPU tensors)."""
    opts = from_rank(root)
    data = pickle.dumps(obj) if group.rank() == root else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    group.broadcast([size], opts).wait()
    buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    if group.rank() == root:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    group.broadcast([buffer], opts).wait()
    return obj if group.rank() == root else pickle.loads(buffer.numpy().tobytes())
