"""A rollout engine on other ranks, seen from the training ranks (disaggregated placement, issue
26; :mod:`megarl.parallel.split_world`).

:class:`RemoteEngine` is the :class:`~megarl.rollout.base.RolloutEngine` the trainer holds when
its vLLM runs on rollout ranks: the trainer's own calls (``generate``, the weight-update session
of :func:`~megarl.rollout.reshard.sync_weights`) reach :func:`serve` on the rollout ranks as
commands over the ``control`` group (the first training rank, then every rollout rank), so a
run is the colocated run's steps with the engine elsewhere. The engines look like one replica of
vLLM TP 1 to the trainer (whole tensors reach the first training rank; vLLM narrows them for its
own TP). It never sleeps: its devices are its own. A batch comes back as the colocated engine
returns it, with the routing vLLM captured for R3 when that is on.

Commands, from the first training rank (every training rank calls every method; the others
wait for its result on the training world):

- ``("generate", [(prompts, kwargs, reward), ...])``: for each request in turn, the rollout
  ranks split the prompts over their vLLM replicas (``rollout.tensor_model_parallel_size``
  consecutive rollout ranks each, :func:`~megarl.rollout.distribute.generate_on_replicas`: the
  tokens do not depend on the number of replicas), gather the batch, score it when ``reward``
  asks, and the first rollout rank sends it back (one reply per request, in order: the
  commands and replies on ``control`` are collectives, so both sides must agree on their
  sequence);
- ``("weights", plan)``: the buckets of ``plan`` follow, as
  :func:`~megarl.rollout.reshard.remote.receive_weights` takes them;
- ``("stop",)``: :func:`serve` returns.

One step off (:meth:`RemoteEngine.prefetch`): the request for step k+1 goes out as soon as step
k's batch is in, so the rollout ranks generate it, with the weights they hold (step k-1's),
while step k trains; the next weight update first takes that batch in (the rollout side is then
waiting to hand it over), and step k+1's ``generate`` returns it. Each batch records the weight
version that generated it (:attr:`RemoteEngine.last_version`: syncs finished before it was
asked for, the first sync being version 0), and the wait for it is timed. ReMax's greedy batch
for step k+1 is asked for right after its sampled one, so both come from the same weights (as
colocated, where the engine generates both between two syncs). Bounded staleness beyond one
step is not built yet.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.parallel.split_world import broadcast_object, from_rank
from megarl.rollout.base import CallOrder, RolloutBatch

__all__ = ["RemoteEngine", "RolloutRanksLost", "serve"]


@dataclass
class _Ahead:
    """A request asked ahead (:meth:`RemoteEngine.prefetch`)."""

    request: tuple
    """(prompts, kwargs), as the later ``generate`` call must repeat them."""
    version: int
    """The weight version the rollout ranks hold when asked (the one that generates it)."""
    reply: Any = None
    """The rollout ranks' reply once received (first training rank; True on the others)."""
    waited_s: float = 0.0
    """Seconds the first training rank waited for the reply."""


class RolloutRanksLost(RuntimeError):
    """The rollout ranks stopped answering the training ranks."""


class RemoteEngine:
    """The training ranks' handle on the rollout ranks' engine (see the module docstring)."""

    tensor_parallel_size = 1
    """What the resharding plan is made for: whole tensors to the first training rank."""
    expert_parallel = False
    dp_rank = 0
    dp_size = 1

    def __init__(self, control: Any | None, *, ranks: Sequence[int] = (), timeout=None) -> None:
        self.control = control
        """``control`` on the first training rank, None on the others."""
        self.ranks = list(ranks)
        """The rollout ranks (the launch's numbering), for the messages."""
        self.timeout = timeout
        self._order = CallOrder()
        self._plan: Any = None
        self._syncs = 0
        """Weight updates finished (the version the engine holds is ``_syncs - 1``)."""
        self._ahead: list[_Ahead] = []
        """The requests asked ahead (:meth:`prefetch`) and not yet taken, in order."""
        self.last_version = -1
        """The weight version that generated the last batch :meth:`generate` returned."""
        self.waited_s = 0.0
        """Seconds the first training rank waited for the last batch :meth:`generate` returned
        (for one asked ahead: when it was taken in, e.g. at the weight update before)."""
        self.prescored: Any = None
        """The last batch's scores when the rollout ranks scored it (:meth:`prefetch` with
        ``reward``): a ``RewardResult``, or the scorer's error as a string; None otherwise."""
        self.rollout_timing: dict[str, float] = {}
        """The rollout side's seconds for the last batch: ``generate``, ``score`` and ``idle``
        (waiting for the request)."""
        self._announced = False
        """This update's ``weights`` command went out (with its first bucket)."""
        self.eos_token_ids: list[int] = self._from_first(
            lambda: self._ask(("eos",)) if control is not None else None
        )

    # -- generation --------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The weight version the engine holds now (syncs finished in this launch, less one)."""
        return self._syncs - 1

    def generate(self, prompts: list[list[int]], **kwargs: Any) -> RolloutBatch:
        self._order.check_can_generate()
        at = next((i for i, a in enumerate(self._ahead) if a.request == (prompts, kwargs)), None)
        if at is not None:  # asked for ahead: its batch (and those asked before it) come in
            self._take_ahead(at + 1)
            ahead = self._ahead.pop(at)
            batch, version, self.waited_s = ahead.reply, ahead.version, ahead.waited_s
        else:  # nothing asked ahead, or other requests (validation): ask now
            self._take_ahead()  # the rollout side is free once it handed those over
            batch, version = None, self._syncs - 1
        self.last_version = version

        def first_rank() -> dict:
            if batch is not None:
                return batch
            return self._ask(("generate", [(prompts, kwargs, None)]))

        reply = self._from_first(first_rank)
        self.prescored, self.rollout_timing = reply["scored"], reply["timing"]
        return reply["batch"]

    def prefetch(self, requests: Sequence[tuple[list[list[int]], dict, dict | None]]) -> None:
        """Ask for the batches that later :meth:`generate` calls with the same arguments
        return: ``requests`` are ``(prompts, kwargs, reward)``, in one command; the rollout
        ranks generate them meanwhile, in order, with the weights they hold now, and score the
        ones with a ``reward`` (:func:`serve`'s scoring request; :attr:`prescored`). One
        command at a time: a step's batch, with ReMax its greedy batch too."""
        if self._ahead:
            raise RuntimeError(f"{len(self._ahead)} batch(es) asked ahead are still outstanding")
        self._ahead = [
            _Ahead((prompts, kwargs), self._syncs - 1) for prompts, kwargs, _ in requests
        ]
        if self.control is not None:
            self._send(("generate", list(requests)))

    def _take_ahead(self, count: int | None = None) -> None:
        """Receive the replies to the first ``count`` requests asked ahead (default: all), those
        not in already, in the order they were asked (first training rank; the others mark
        them in), with the wait for each."""
        for ahead in self._ahead[:count]:
            if ahead.reply is None:
                ahead.reply = self._receive() if self.control is not None else True
                ahead.waited_s = self.waited_s

    def sleep(self, level: int = 1) -> None:
        """Nothing to free: the engine's devices are not the trainer's."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Never asleep."""

    # -- weights -----------------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        self._order.begin_update()
        self._take_ahead()  # the rollout side hands them over before it takes weights

    def bind_plan(self, plan: Any) -> None:
        """The plan every sync follows (sent with each ``weights`` command)."""
        self._plan = plan

    def load_weight_chunk(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self._order.check_updating("load_weight_chunk")
        if self.control is None:
            return
        if not self._announced:
            self._send(("weights", self._plan))
            self._announced = True
        flat = torch.cat([t.reshape(-1).cpu() for _, t in named_tensors])
        with self._answering():
            self.control.broadcast([flat], from_rank(0)).wait()

    def finish_weight_update(self) -> None:
        self._order.finish_update()
        self._announced = False
        self._syncs += 1

    def shutdown(self) -> None:
        """Stop the rollout ranks (batches asked ahead and still coming are taken in first)."""
        self._take_ahead()
        if self.control is not None:
            self._send(("stop",))

    # -- plumbing ----------------------------------------------------------------------------

    def _ask(self, command: tuple) -> Any:
        self._send(command)
        return self._receive()

    def _send(self, command: tuple) -> None:
        with self._answering():
            broadcast_object(self.control, command, 0)

    def _receive(self) -> Any:
        start = time.perf_counter()
        with self._answering():
            batch = broadcast_object(self.control, None, 1)
        self.waited_s = time.perf_counter() - start
        return batch

    @contextlib.contextmanager
    def _answering(self):
        """A collective with the rollout ranks that fails (they died, or hung past the
        timeout) becomes one line naming them."""
        try:
            yield
        except RuntimeError as exc:
            raise RolloutRanksLost(
                f"the rollout rank(s) {self.ranks} did not answer within {self.timeout} (dead "
                f"or hung): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from exc

    def _from_first(self, compute) -> Any:
        """``compute()`` on the first training rank, its result on every training rank."""
        box = [compute() if self.control is not None else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]


def serve(engine: Any, control: Any, score: Any = None) -> None:
    """The rollout ranks' side: run the training ranks' commands on ``engine`` (this rank's
    part of the rollout ranks' vLLM replicas) until ``stop``.

    ``score(batch, reward)``: scores a generated batch when its request asks for it (every
    rollout rank calls it, as the reward manager is collective); its error goes back as text.
    """
    from megarl.rollout.reshard.remote import receive_weights

    first = control.rank() == 1
    while True:
        waiting = time.perf_counter()
        command = broadcast_object(control, None, 0)
        idle = time.perf_counter() - waiting
        if command[0] == "stop":
            return
        if command[0] == "eos":
            broadcast_object(control, list(engine.eos_token_ids) if first else None, 1)
        elif command[0] == "generate":
            for prompts, kwargs, reward in command[1]:  # one reply each, in order
                reply = _generate(engine, prompts, kwargs, reward, score)
                reply["timing"]["idle"] = idle
                broadcast_object(control, reply if first else None, 1)
                idle = 0.0
        elif command[0] == "weights":
            receive_weights(engine, command[1], control)
        else:
            raise ValueError(f"unknown rollout command {command[0]!r}")


def _generate(engine: Any, prompts: list, kwargs: dict, reward: dict | None, score: Any) -> dict:
    """One request of a ``generate`` command: the batch, its scores when asked (a result, or
    an error's one line: the scorer's own, or this one) and the seconds spent."""
    from megarl.rollout.distribute import generate_on_replicas

    start = time.perf_counter()
    batch = generate_on_replicas(engine, prompts, **kwargs)
    generated = time.perf_counter()
    scored = None
    if reward is not None and score is not None:
        try:
            scored = score(batch, reward)
        except Exception as exc:  # noqa: BLE001 -- the trainer raises it, in one line
            scored = f"{type(exc).__name__}: {exc}"
    timing = {"generate": generated - start, "score": time.perf_counter() - generated}
    return {"batch": batch, "scored": scored, "timing": timing}
