"""The rollout ranks' side of partial rollouts (``async_training.partial_rollout``): between two
engine steps, a weight update the trainer announced stops every rollout replica's requests at
the same token boundary; the update is loaded; the requests go on (:mod:`megarl.rollout.partial`).

:class:`ServeInterrupts` is the :class:`~megarl.rollout.partial.Interrupts` of
:func:`~megarl.rollout.remote.serve.serve`'s main thread. Commands keep arriving on the commands
thread while a request generates; the ones taken in are kept, in order, in ``pending``, and a
``weights`` command among them is run first, out of order: in a fully-async run the rollout
ranks always generate with the newest weights, and every token records the version that
sampled it. The ranks agree on when to stop with one all-reduce of two flags per engine step
over the rollout ranks' gloo group (a rank that has finished its share keeps answering it).
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ServeInterrupts"]


class ServeInterrupts:
    """Interrupts for the requests of one rollout rank's serving loop.

    ``inbox``: the commands thread's queue of ``(arrival time, command)`` (``(None, error)``
    from a failed thread); ``pending``: commands taken in and not yet run, in order; ``load``:
    runs one ``weights`` command (receives and loads its buckets); ``version``: the version the
    engine holds.
    """

    def __init__(
        self,
        inbox: queue.Queue,
        pending: deque,
        load: Callable[[tuple], None],
        version: int,
        group: Any = None,
    ) -> None:
        self.inbox, self.pending, self._load = inbox, pending, load
        self.version = version
        self.group = group
        self.interruptions = 0
        """Requests stopped for an update (all replicas at once count once), since created."""
        self.loaded_s = 0.0
        """Seconds spent receiving and loading updates, since created."""

    def take_in(self) -> None:
        """Move every command that has arrived into ``pending`` (a thread's error is raised)."""
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] is None:
                raise item[1]
            self.pending.append(item)

    def update_pending(self) -> bool:
        return any(command[0] == "weights" for _, command in self.pending)

    def poll(self, busy: bool) -> tuple[bool, bool]:
        stop, anyone, _, _ = self.poll_stream(busy, 0, 0)
        if stop:
            self.interruptions += 1
        return stop, anyone

    def poll_stream(self, busy: bool, available: int, finished: int) -> tuple[bool, bool, int, int]:
        """:meth:`poll` for continuous batching (:mod:`megarl.rollout.remote.stream`): also the
        fewest requests any rank has ``available`` to start and the fewest of the oldest
        requests any replica has ``finished``; collective. Counts no interruption."""
        self.take_in()
        flags = torch.tensor(
            [int(self.update_pending()), int(busy), -available, -finished], dtype=torch.int64
        )
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        stop, anyone, fewest, oldest = (int(f) for f in flags)
        return bool(stop), bool(anyone), -fewest, -oldest

    def swap(self) -> None:
        """Run the first ``weights`` command taken in; on a rank whose commands thread has not
        received it yet (another rank saw it first), wait for it."""
        while not self.update_pending():
            item = self.inbox.get()
            if item[0] is None:
                raise item[1]
            self.pending.append(item)
        at = next(i for i, (_, c) in enumerate(self.pending) if c[0] == "weights")
        _, command = self.pending[at]
        del self.pending[at]
        start = time.perf_counter()
        self._load(command)
        self.loaded_s += time.perf_counter() - start
        self.version = command[1]
