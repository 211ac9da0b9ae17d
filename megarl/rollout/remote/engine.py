"""The training ranks' handle on vLLM running on rollout ranks of its own (:mod:`.split_world`).

:class:`RemoteEngine` turns the trainer's engine calls into commands that
:func:`~megarl.rollout.remote.serve.serve` runs on the rollout ranks. Only the first training rank
talks to them, over the three groups of :class:`~megarl.rollout.remote.split_world.Channels`;
every training rank calls every method, and the others get its results over the training world.
Commands, broadcast on ``control`` and run by the rollout ranks in the order sent:

- ``("generate", version, [(prompts, kwargs, reward), ...])``: each request in turn, generated
  over the rollout ranks' vLLM replicas with weight version ``version`` (the trainer's newest
  when it asked) and scored when ``reward`` is given; the first rollout rank sends one reply per
  request, in order, on ``replies`` (``{"batch", "scored", "timing"}``); a request whose kwargs
  hold ``multi_turn=True`` carries the step's ``TrajectoryPrompt`` list instead of token ids and
  gets the trajectories back as its ``batch`` (the whole multi-turn loop, tools included, runs
  on the rollout ranks: :class:`~megarl.rollout.multi_turn_rollout.MultiTurnRollout`);
- ``("weights", version, plan)``: the buckets of ``plan`` follow on ``weights``
  (:mod:`.weights`); version ``k`` is the update after ``k`` finished syncs (-1: the weights
  vLLM started with). The rollout ranks load a version between two requests, never inside one;
- ``("adapter", version, tensors, peft_config)``: ``lora.merge=false``: the actor's LoRA
  adapters (PEFT-named, full-shaped CPU tensors, in the command itself), loaded as vLLM's
  adapter (``VLLMEngine.load_adapter``) when the rollout ranks reach the command: with the
  version of the full update just before it (the first sync: the base, then the adapters), or
  as a version of their own (every later sync);
- ``("eos",)``: the engine's EOS token ids come back on ``replies``;
- ``("stop",)``: ``serve`` returns.
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

from megarl.rollout.base import CallOrder, RolloutBatch
from megarl.rollout.remote.split_world import Channels, broadcast_object, from_rank

__all__ = ["RemoteEngine", "RolloutRanksLost"]


@dataclass
class _Ahead:
    """A request asked ahead (:meth:`RemoteEngine.prefetch`)."""

    request: tuple
    """(prompts, kwargs), as the later ``generate`` call must repeat them."""
    version: int
    """The trainer's newest weight version when asked: the one that generates it."""
    reply: Any = None
    """The rollout ranks' reply once received (first training rank; True on the others)."""
    waited_s: float = 0.0
    """Seconds the first training rank waited for the reply."""


class RolloutRanksLost(RuntimeError):
    """The rollout ranks stopped answering the training ranks."""


class RemoteEngine:
    """The training ranks' handle on the rollout ranks' engine (protocol: the module docstring).

    To the trainer it is one replica of vLLM TP 1: the resharding plan is made for TP 1, so whole
    tensors reach the first training rank, and vLLM narrows them for its own TP. It never sleeps:
    its devices are its own.

    Asking ahead (:meth:`prefetch`): the requests for the next steps go out as soon as this
    step's batch is in, and the rollout ranks generate them, with the weights the trainer holds
    when asking, while this step trains; a later :meth:`generate` with the same arguments returns
    the batch (:attr:`last_version`: the weights that made it). ReMax's greedy batch is asked for
    in the same command as its sampled one, so both come from the same weights. A weight update
    with ``streams`` (beyond one step off) goes to the rollout ranks' staging slot while they
    generate; otherwise the sync first takes in the batches asked before it
    (:attr:`sync_waited_s`), so the rollout ranks are idle when the bytes go.
    """

    tensor_parallel_size = 1
    """What the resharding plan is made for: whole tensors to the first training rank."""
    expert_parallel = False
    runs_multi_turn = True
    """Multi-turn rollouts run whole on the rollout ranks (``MultiTurnRollout.remote_request``)."""
    dp_rank = 0
    dp_size = 1

    def __init__(
        self,
        channels: Channels | None,
        *,
        ranks: Sequence[int] = (),
        timeout=None,
        streams: bool = False,
        rollout_tp: int = 1,
        lora: bool = False,
        partial: bool = False,
    ) -> None:
        self.channels = channels
        """The groups with the rollout ranks on the first training rank, None on the others."""
        self.streams = streams
        """Whether weight updates stream to the rollout ranks while they generate (beyond one
        step off, into a staging slot); False: an update goes in once the batches asked before
        it are in, which the sync takes first."""
        self.partial = partial
        """Partial rollouts: a weight update interrupts the rollout ranks' request in progress
        (:mod:`megarl.rollout.remote.interrupts`), so the sync waits for no batch asked before
        it; each sample's ``token_versions`` say which weights sampled each token."""
        self.rollout_tp = rollout_tp
        """The rollout ranks' vLLM TP size: streaming, each rank receives only its TP rank's
        pieces (:func:`~megarl.rollout.remote.weights.pack_part`)."""
        self._bucket = 0
        """The next bucket of the update in progress."""
        self.update_bytes = 0
        """Bytes the rollout ranks received of the last weight update, all of them together
        (first training rank)."""
        self.sync_waited_s = 0.0
        """Seconds the last weight sync waited for the batches asked before it (not streaming;
        first training rank)."""
        self.ranks = list(ranks)
        """The rollout ranks (the launch's numbering), for the messages."""
        self.timeout = timeout
        if lora and streams:  # serve's staging slot holds plan buckets, not adapters
            raise ValueError("adapter-only updates (lora) are not built for staged updates")
        self.lora_adapter_sync = lora
        """``lora.merge=false`` (the rollout ranks' vLLM has its LoRA layers): the base goes once
        through the plan, then the adapters alone (:meth:`load_adapter`)."""
        self.base_loaded = False
        """A full update has finished in this launch (the rollout ranks' vLLM starts with dummy
        weights)."""
        self._fresh_base = False
        """The last full update has just finished: adapters now complete its version."""
        self._order = CallOrder()
        self._plan: Any = None
        self._syncs = 0
        """Weight updates finished (the version the engine holds is ``_syncs - 1``)."""
        self._ahead: list[_Ahead] = []
        """The requests asked ahead (:meth:`prefetch`) and not yet taken, in order."""
        self.version_steps: dict[int, int] = {}
        """Weight version -> the trainer step after which the trainer synced it (the trainer
        fills it in; 0 for the initial weights)."""
        self.last_version = -1
        """The weight version that generated the last batch :meth:`generate` returned."""
        self.waited_s = 0.0
        """Seconds the first training rank waited for the last batch :meth:`generate` returned
        (for one asked ahead: when it was taken in, maybe before a later request's)."""
        self.prescored: Any = None
        """The last batch's scores when the rollout ranks scored it (:meth:`prefetch` with
        ``reward``): a ``RewardResult``, or the scorer's error as a string; None otherwise."""
        self.rollout_timing: dict[str, float] = {}
        """The rollout side's seconds for the last batch: ``generate``, ``score``, ``idle``
        (waiting for the request) and ``update_weights`` (loading its version first)."""
        self.eos_token_ids: list[int] = self._from_first(
            lambda: self._ask(("eos",)) if channels is not None else None
        )

    # -- generation --------------------------------------------------------------------------

    @property
    def weights_link(self) -> str | None:
        """How the weight buckets travel: ``NCCL`` (GPU to GPU) or ``gloo`` (host memory); None
        on the training ranks after the first."""
        if self.channels is None:
            return None
        return "NCCL" if self.channels.weights_device.type == "cuda" else "gloo"

    @property
    def version(self) -> int:
        """The weight version the engine holds now (syncs finished in this launch, less one)."""
        return self._syncs - 1

    def generate(self, prompts: list[list[int]], **kwargs: Any) -> RolloutBatch:
        self._order.check_can_generate()
        self._fresh_base = False  # adapters from here are a version of their own
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
            return self._ask(("generate", version, [(prompts, kwargs, None)]))

        reply = self._from_first(first_rank)
        self.prescored, self.rollout_timing = reply["scored"], reply["timing"]
        return reply["batch"]

    def prefetch(self, requests: Sequence[tuple[list[list[int]], dict, dict | None]]) -> None:
        """Ask for the batches that later :meth:`generate` calls with the same arguments
        return: ``requests`` are ``(prompts, kwargs, reward)``, in one command; the rollout
        ranks generate them, after those asked before, in order, with the weights the trainer
        holds now, and score the ones with a ``reward`` (the rollout side's ``score``;
        :attr:`prescored`). One command per step asked ahead: its batch, with ReMax its greedy
        batch too."""
        version = self._syncs - 1
        self._fresh_base = False
        self._ahead += [_Ahead((prompts, kwargs), version) for prompts, kwargs, _ in requests]
        if self.channels is not None:
            self._send(("generate", version, list(requests)))

    def _take_ahead(self, count: int | None = None, *, timed: bool = True) -> None:
        """Receive the replies to the first ``count`` requests asked ahead (default: all), those
        not in already, in the order they were asked (first training rank; the others mark
        them in), with the wait for each (0 unless ``timed``: a wait the caller counts)."""
        for ahead in self._ahead[:count]:
            if ahead.reply is None:
                ahead.reply = self._receive() if self.channels is not None else True
                ahead.waited_s = self.waited_s if timed else 0.0

    def sleep(self, level: int = 1) -> None:
        """Nothing to free: the engine's devices are not the trainer's."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Never asleep."""

    # -- weights -----------------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        """Announce the next version (its buckets follow): streaming, the batches asked ahead go
        on generating meanwhile, the bytes going to a staging slot; otherwise once the batches
        asked before are in (taken now, the wait timed in :attr:`sync_waited_s`)."""
        self._order.begin_update()
        self._fresh_base = False
        start = time.perf_counter()
        if not self.streams and not self.partial:
            self._take_ahead(timed=False)
        self.sync_waited_s = time.perf_counter() - start
        self._bucket, self.update_bytes = 0, 0
        if self.channels is not None:
            self._send(("weights", self._syncs, self._plan))

    def bind_plan(self, plan: Any) -> None:
        """The plan every sync follows (sent with each ``weights`` command)."""
        self._plan = plan

    def load_weight_chunk(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self._order.check_updating("load_weight_chunk")
        if self.channels is None:
            return
        if self.streams:
            self._send_parts(list(named_tensors))
            return
        device = self.channels.weights_device
        flat = torch.cat([t.reshape(-1).to(device) for _, t in named_tensors])
        with self._answering():
            self.channels.weights.broadcast([flat], from_rank(0)).wait()
        self.update_bytes += flat.numel() * flat.element_size() * len(self.ranks)

    def _send_parts(self, named: list[tuple[str, Tensor]]) -> None:
        """Send each rollout rank its vLLM TP rank's pieces of the next bucket (staged there)."""
        from megarl.rollout.remote.weights import pack_part

        bucket = self._plan.buckets[self._bucket]
        self._bucket += 1
        if [n for n, _ in named] != [s.name for s in bucket.slots]:
            raise RuntimeError(f"weight bucket {bucket.index} is not the plan's: {named[0][0]} ...")
        tensors = [t.to(self.channels.weights_device) for _, t in named]
        packs: dict[int, Tensor] = {}
        with self._answering():
            works = []
            for member in range(1, len(self.ranks) + 1):  # the group's rollout ranks, in order
                tp_rank = (member - 1) % self.rollout_tp
                if tp_rank not in packs:
                    packs[tp_rank] = pack_part(self._plan, bucket, tensors,
                                               (self.rollout_tp, tp_rank))  # fmt: skip
                if packs[tp_rank].numel():  # receive_buckets expects nothing for an empty one
                    works.append(self.channels.weights.send([packs[tp_rank]], member, 0))
                self.update_bytes += packs[tp_rank].numel() * packs[tp_rank].element_size()
            for work in works:
                work.wait()

    def finish_weight_update(self) -> None:
        self._order.finish_update()
        if self.channels is not None and self.channels.weights_device.type == "cuda":
            with self._answering():  # NCCL's wait only ordered the stream: the bytes are out
                torch.cuda.synchronize(self.channels.weights_device)
        self._syncs += 1
        self.base_loaded = self._fresh_base = True

    def load_adapter(self, tensors: dict[str, Tensor], peft_config: dict[str, Any]) -> int:
        """``lora.merge=false``: the actor's adapters (PEFT-named, full-shaped, the same on every
        training rank; :meth:`VLLMEngine.load_adapter <megarl.rollout.vllm_engine.VLLMEngine.
        load_adapter>` says the form) to the rollout ranks, whose vLLM puts them on every
        request from then on. Right after a full update they complete its version (the first
        sync: the base, then the adapters); otherwise they are the next version. They travel
        in the ``adapter`` command (the control group, host memory: a small fraction of the
        model's bytes), so the rollout ranks take them in while generating and load them when
        they reach the command; the sync waits for nothing. Returns the adapter bytes handed
        over (:attr:`update_bytes` counts them once per rollout rank)."""
        if not self.lora_adapter_sync:
            raise RuntimeError("load_adapter: the rollout ranks' vLLM has no LoRA layers")
        if self._order.updating:
            raise RuntimeError("load_adapter during an open weight update (finish it first)")
        if not self.base_loaded:
            raise RuntimeError("load_adapter before the base weights: sync the full model first")
        sent = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._fresh_base:  # the first sync: the base's version gets its adapters
            version, self._fresh_base = self._syncs - 1, False
            self.update_bytes += sent * len(self.ranks)
        else:
            version, self.sync_waited_s = self._syncs, 0.0
            self.update_bytes = sent * len(self.ranks)
        if self.channels is not None:
            on_host = {name: t.detach().cpu() for name, t in tensors.items()}
            self._send(("adapter", version, on_host, dict(peft_config)))
        self._syncs = version + 1
        return sent

    def shutdown(self) -> None:
        """Stop the rollout ranks (batches asked ahead and still coming are taken in first)."""
        self._take_ahead()
        if self.channels is not None:
            self._send(("stop",))

    # -- plumbing ----------------------------------------------------------------------------

    def _ask(self, command: tuple) -> Any:
        self._send(command)
        return self._receive()

    def _send(self, command: tuple) -> None:
        with self._answering():
            broadcast_object(self.channels.control, command, 0)

    def _receive(self) -> Any:
        start = time.perf_counter()
        with self._answering():
            batch = broadcast_object(self.channels.replies, None, 1)
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
        """``compute()`` on the first training rank, its result on every training rank (over
        gloo: an object collective on NCCL would stage every pickled rollout batch, R3 routing
        included, on each GPU; megarl.rollout.distribute.object_group)."""
        from megarl.rollout.distribute import object_group

        box = [compute() if self.channels is not None else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0, group=object_group(None))
        return box[0]
