"""What the resharding tests and ``tools/bench_reshard.py`` measure a weight sync with: the live
bytes it allocates (:class:`LiveBytes`), the bytes it receives at ``torch.distributed``'s entry
points (:class:`WireMeter`), and a fake engine that copies into preallocated tensors
(:class:`CopySink`)."""

from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Self

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

SETTLE_S = 0.05
"""How long a storage that would raise the measured peak waits for a pending release."""
BOUND_SETTLE_S = 5.0
"""How long a storage that would take the live bytes past the ``bound`` being checked waits for
a pending release (once: a wait that runs out means the bound is truly passed)."""


class LiveBytes(TorchDispatchMode):
    """Counts bytes of tensor storages allocated while active and still alive; keeps the peak.

    A storage is counted when an op returns a tensor on memory none of its inputs used (views
    and in-place results of older memory are not), and released when the last Python tensor
    seen on it is garbage-collected. Temporaries made inside C++ kernels (e.g. in a collective)
    are not seen.

    Before an op without tensor inputs (a factory: a new buffer) the meter yields the GIL: a
    finished gloo collective is dropped by gloo's worker thread, which needs the GIL to release
    the Python tensor, so the buffer of the previous bucket could otherwise still look alive.
    (The yield can only lower the peak to the true one: a missed release over-counts, so a
    slow machine can fail the bound, never pass it wrongly.) The yield alone once missed one on
    a quiet machine (a 512-byte buffer still alive: 786944 > 786432), so before a storage raises
    the peak the meter also waits, up to :data:`SETTLE_S`, for a release that brings the live
    bytes back under it. Releases are signalled, so the end of a sync waits on them
    (:meth:`wait_released`), not on a clock.
    """

    def __init__(self, bound: int | None = None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.bound = bound
        """The bound the caller checks the peak against: a storage that would pass it waits up
        to :data:`BOUND_SETTLE_S` for a release in flight (gloo's thread can hold the previous
        bucket's buffer longer than :data:`SETTLE_S` on a busy machine; a CI run once measured
        1298432 > 786432 so, and 14 passes on rerun)."""
        self._bound_wait_s = BOUND_SETTLE_S
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [python refs, nbytes]
        self._released = threading.Condition()

    def wait_released(self, timeout_s: float) -> int:
        """Wait until nothing allocated under the meter is alive (releases may come from gloo's
        thread), at most ``timeout_s``; returns the bytes still alive."""
        with self._released:
            self._released.wait_for(lambda: self.live == 0, timeout=timeout_s)
        return self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        if not inputs:
            time.sleep(0.002)  # yield the GIL to gloo's thread (see the class docstring)
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0:
                continue
            entry = self._storages.get(key)
            if entry is None:
                if key in inputs:
                    continue  # a view / in-place result of memory allocated before
                entry = self._storages[key] = [0, nbytes]
                self._settle(nbytes)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            entry[0] += 1
            weakref.finalize(t, self._release, key)
        return out

    def _settle(self, nbytes: int) -> None:
        """Before ``nbytes`` more would set a new peak, give a release in flight (a finished
        collective's buffer that gloo's thread has yet to drop) up to :data:`SETTLE_S` to land.
        Only waits when the peak would rise; a true new peak costs the wait and stands."""
        with self._released:
            past = self.bound is not None and self.live + nbytes > self.bound
            if past and self._bound_wait_s > 0:
                settled = self._released.wait_for(
                    lambda: self.live + nbytes <= self.bound, timeout=self._bound_wait_s
                )
                self._bound_wait_s = self._bound_wait_s if settled else 0.0  # passed for real
            self._released.wait_for(lambda: self.live + nbytes <= self.peak, timeout=SETTLE_S)

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            with self._released:
                self.live -= entry[1]
                del self._storages[key]
                self._released.notify_all()


class WireMeter:
    """Counts the bytes the resharding executor receives, at ``torch.distributed``'s entry
    points, independently of the executor's own ``SyncStats``: a broadcast where this rank is
    not the source and a ``recv`` count their tensor (``pipeline``; ``ep`` for a broadcast over
    the expert-parallel group), an all-gather its output minus this rank's input (``tp``). Only
    calls made from the executor module count (vLLM shares the process and has collectives of
    its own)."""

    MODULE = "megarl.rollout.reshard.executor"

    def __init__(self) -> None:
        self.pipeline = 0
        self.tp = 0
        self.ep = 0
        self._saved: dict = {}

    def _ours(self) -> bool:
        return sys._getframe(2).f_globals.get("__name__") == self.MODULE

    def __enter__(self) -> Self:
        import torch.distributed as dist
        from megatron.core import parallel_state

        broadcast, recv, gather = dist.broadcast, dist.recv, dist.all_gather_into_tensor
        self._saved = {"broadcast": broadcast, "recv": recv, "all_gather_into_tensor": gather}
        ep_group = parallel_state.get_expert_model_parallel_group(check_initialized=False)

        def metered_broadcast(tensor, src, *args, **kwargs):
            if self._ours() and dist.get_rank() != src:
                if ep_group is not None and kwargs.get("group") is ep_group:
                    self.ep += tensor.nbytes
                else:
                    self.pipeline += tensor.nbytes
            return broadcast(tensor, src, *args, **kwargs)

        def metered_recv(tensor, *args, **kwargs):
            if self._ours():
                self.pipeline += tensor.nbytes
            return recv(tensor, *args, **kwargs)

        def metered_gather(output, input, *args, **kwargs):
            if self._ours():
                self.tp += output.nbytes - input.nbytes
            return gather(output, input, *args, **kwargs)

        dist.broadcast = metered_broadcast
        dist.recv = metered_recv
        dist.all_gather_into_tensor = metered_gather
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)


class CopySink:
    """A fake engine: copies every tensor into a preallocated one (like a loader would)."""

    def __init__(self, plan, device: str = "cpu", retain: bool = False) -> None:
        self.dest = {
            s.name: torch.zeros(s.shape, dtype=plan.dtype, device=device)
            for b in plan.buckets
            for s in b.slots
        }
        self.calls: list = []
        self.retain = retain
        self.kept: list = []

    def begin_weight_update(self) -> None:
        self.calls.append("begin")

    def load_weight_chunk(self, named_tensors) -> None:
        count = 0
        for name, tensor in named_tensors:
            self.dest[name].copy_(tensor)
            if self.retain:  # a leaky engine: keeps references to every bucket
                self.kept.append(tensor)
            count += 1
        self.calls.append(count)

    def finish_weight_update(self) -> None:
        self.calls.append("finish")


# --------------------------------------------------------------------------------------------
# Models, noise, references
# --------------------------------------------------------------------------------------------
