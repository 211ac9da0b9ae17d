"""Which communicators a process uses: every collective and point-to-point call of
``torch.distributed`` logged by group (and, for a single send or receive, by pair of ranks).

Install it before Megatron is imported (some modules keep a reference to a collective taken at
import). The wrappers call the real functions; they only note the call. A group created with
``backend="gloo"`` is an object group (gloo on a GPU too) and is left out of what it reports:
on CPU every group is gloo, so the backend asked for is what says whether the group would be
NCCL on a GPU.
"""

from __future__ import annotations

import inspect
import threading

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "reduce_scatter", "broadcast", "reduce", "all_to_all_single", "all_to_all", "gather",
    "scatter", "_all_gather_base", "_reduce_scatter_base",
)  # fmt: skip
SENDS = {"isend": "dst", "irecv": "src", "send": "dst", "recv": "src"}


class CollectiveLog:
    """``used``: ``(group, None)`` for a collective, ``(group, (low, high))`` for a single send
    or receive between global ranks low and high, each once, in first-use order; only while
    ``recording``."""

    def __init__(self) -> None:
        self.recording = False
        self.used: list[tuple[object, tuple[int, int] | None]] = []
        self.gloo: list[object] = []
        self._batch = threading.local()

    def _note(self, group, pair) -> None:
        if not self.recording:
            return
        group = dist.group.WORLD if group is None else group
        if any(group is g for g in self.gloo):
            return
        if not any(group is g and pair == p for g, p in self.used):
            self.used.append((group, pair))

    def install(self) -> None:
        for name in COLLECTIVES:
            if hasattr(c10d, name):
                self._wrap(name, self._collective)
        for name, peer in SENDS.items():
            self._wrap(name, self._p2p(peer))
        self._wrap("batch_isend_irecv", self._batched)
        self._wrap("new_group", self._new_group)

    def _wrap(self, name: str, make) -> None:
        original = getattr(c10d, name)
        wrapped = make(original)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)

    def _collective(self, original):
        signature = inspect.signature(original)

        def call(*args, **kwargs):
            self._note(signature.bind_partial(*args, **kwargs).arguments.get("group"), None)
            return original(*args, **kwargs)

        return call

    def _p2p(self, peer_key: str):
        def make(original):
            signature = inspect.signature(original)

            def call(*args, **kwargs):
                bound = signature.bind_partial(*args, **kwargs).arguments
                group, peer = bound.get("group"), bound.get(peer_key)
                if peer is None and bound.get(f"group_{peer_key}") is not None:
                    peer = dist.get_global_rank(group, bound[f"group_{peer_key}"])
                if getattr(self._batch, "active", False):  # a coalesced batch: the collective one
                    self._note(group, None)
                elif peer is not None:
                    me = dist.get_rank()
                    self._note(group, (min(me, peer), max(me, peer)))
                return original(*args, **kwargs)

            return call

        return make

    def _batched(self, original):
        def call(p2p_op_list):
            self._batch.active = True
            try:
                return original(p2p_op_list)
            finally:
                self._batch.active = False

        return call

    def _new_group(self, original):
        def call(*args, **kwargs):
            group = original(*args, **kwargs)
            if kwargs.get("backend") == "gloo" and group is not None:
                self.gloo.append(group)
            return group

        return call
