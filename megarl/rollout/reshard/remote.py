"""Weights from the training ranks to rollout engines on other ranks (disaggregated placement,
issue 26; :mod:`megarl.parallel.split_world`).

The training ranks run the resharding plan as for a colocated engine (:func:`sync_weights`:
TP all-gathers, pipeline and expert moves), made for vLLM TP 1 so that whole tensors reach the
first training rank; that rank hands each bucket, its HF tensors back to back, to a broadcast
over ``group`` (itself first, then every rollout rank), and the other training ranks drop
theirs. Each rollout rank receives the buckets in plan order and loads them into its engine in
one weight-update session (vLLM narrows each tensor for its own TP rank, so any rollout TP
works). Both sides compute the same pure plan; the rollout side needs no Megatron.

Until the update is finished the engine keeps generating with its previous weights: a rollout
rank switches between requests, never inside one.

Not yet: slices per vLLM TP rank (every rollout rank receives whole tensors) and an NCCL group
for the bytes (gloo through host memory today).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from megarl.rollout.base import WeightSink
from megarl.rollout.reshard.executor import SyncStats, sync_weights
from megarl.rollout.reshard.plan import ReshardPlan

__all__ = ["receive_weights", "send_weights"]


def send_weights(
    chunks: Sequence[torch.nn.Module], plan: ReshardPlan, group: Any | None
) -> SyncStats:
    """Training ranks (every one: the gathers are collective): run ``plan`` (made for vLLM TP
    1) and, on the rank that is ``group``'s root (the first training rank), broadcast each
    bucket to the rollout ranks; ``group`` is None on the other training ranks."""
    if plan.rollout_tp != 1:
        raise ValueError(f"a remote sync plan is made for vLLM TP 1, got {plan.rollout_tp}")
    sink = _Broadcast(group) if group is not None else _Discard()
    return sync_weights(chunks, plan, sink)


def receive_weights(engine: WeightSink, plan: ReshardPlan, group: Any) -> int:
    """Rollout ranks: receive every bucket of ``plan`` from ``group``'s root and load it into
    ``engine`` (one weight-update session); returns the bytes received."""
    received = 0
    engine.begin_weight_update()
    for bucket in plan.buckets:
        slots = bucket.slots
        flat = torch.empty(sum(s.numel for s in slots), dtype=plan.dtype)
        group.broadcast([flat], _root()).wait()
        received += flat.nbytes
        named, at = [], 0
        for s in slots:
            named.append((s.name, flat[at : at + s.numel].view(s.shape)))
            at += s.numel
        engine.load_weight_chunk(named)
    engine.finish_weight_update()
    return received


def _root():
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


class _Broadcast:
    """The sending rank's sink: each chunk's tensors, back to back, broadcast from here."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def begin_weight_update(self) -> None:
        pass

    def load_weight_chunk(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        flat = torch.cat([t.reshape(-1).cpu() for _, t in named_tensors])
        self.group.broadcast([flat], _root()).wait()

    def finish_weight_update(self) -> None:
        pass


class _Discard:
    """The other training ranks' sink: their copies of the buckets go nowhere."""

    def begin_weight_update(self) -> None:
        pass

    def load_weight_chunk(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass
