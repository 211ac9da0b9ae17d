"""Weights from the training ranks to rollout engines on other ranks (disaggregated placement,
issue 26; :mod:`megarl.parallel.split_world`).

The training ranks run the resharding plan as for a colocated engine
(:func:`~megarl.rollout.reshard.sync_weights`: TP all-gathers, pipeline and expert moves) into
a :class:`~megarl.rollout.remote_engine.RemoteEngine`; the plan is made for vLLM TP 1, so that
whole tensors reach the first training rank, which broadcasts each bucket, its HF tensors back
to back, over the ``weights`` group (itself first, then every rollout rank); the other training
ranks drop theirs. Each rollout rank receives the buckets in plan order and loads them into its
engine in one weight-update session between two requests: straight in, bucket by bucket, or
(bounded staleness beyond one step) received on a thread of its own into a staging copy while the
engine goes on generating, and loaded when a request asks for that version
(:mod:`megarl.rollout.remote_serve`; vLLM narrows each tensor for its own TP rank, so any
rollout TP works). The plan travels with the command; the rollout side needs no Megatron.

The bytes go over NCCL, GPU to GPU, when every member of the group has a GPU of its own and
the rollout side loads each update straight in (at most one step off); over gloo through host
memory otherwise (:meth:`~megarl.parallel.split_world.SplitWorld.channels`). Not yet: slices per
vLLM TP rank (every rollout rank receives whole tensors).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megarl.parallel.split_world import HOST, from_rank
from megarl.rollout.base import WeightSink
from megarl.rollout.reshard.plan import ReshardPlan

__all__ = ["load_buckets", "receive_buckets"]


def receive_buckets(
    plan: ReshardPlan, group: Any, device: torch.device = HOST
) -> Iterator[torch.Tensor]:
    """Rollout ranks: every bucket of ``plan`` from ``group``'s root, in plan order (each its
    HF tensors back to back, on ``device``), each received when the caller asks for it."""
    for bucket in plan.buckets:
        flat = torch.empty(sum(s.numel for s in bucket.slots), dtype=plan.dtype, device=device)
        group.broadcast([flat], from_rank(0)).wait()
        yield flat


def load_buckets(engine: WeightSink, plan: ReshardPlan, flats: Iterable[torch.Tensor]) -> None:
    """Load ``plan``'s buckets into ``engine``, in one weight-update session: from a staged list,
    or straight from :func:`receive_buckets` (each bucket loaded as it comes in)."""
    engine.begin_weight_update()
    for bucket, flat in zip(plan.buckets, flats, strict=True):
        named, at = [], 0
        for s in bucket.slots:
            named.append((s.name, flat[at : at + s.numel].view(s.shape)))
            at += s.numel
        engine.load_weight_chunk(named)
    engine.finish_weight_update()
