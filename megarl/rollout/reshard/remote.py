"""Weights from the training ranks to rollout engines on other ranks (disaggregated placement,
issue 26; :mod:`megarl.parallel.split_world`).

The training ranks run the resharding plan as for a colocated engine
(:func:`~megarl.rollout.reshard.sync_weights`: TP all-gathers, pipeline and expert moves) into
a :class:`~megarl.rollout.remote_engine.RemoteEngine`; the plan is made for vLLM TP 1, so that
whole tensors reach the first training rank, which broadcasts each bucket, its HF tensors back
to back, over the control group (itself first, then every rollout rank); the other training
ranks drop theirs. Each rollout rank receives the buckets in plan order and loads them into its
engine in one weight-update session (vLLM narrows each tensor for its own TP rank, so any
rollout TP works). The plan travels with the command; the rollout side needs no Megatron.

Until the update is finished the engine keeps generating with its previous weights: a rollout
rank switches between requests, never inside one.

Not yet: slices per vLLM TP rank (every rollout rank receives whole tensors) and an NCCL group
for the bytes (gloo through host memory today).
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.parallel.split_world import from_rank
from megarl.rollout.base import WeightSink
from megarl.rollout.reshard.plan import ReshardPlan

__all__ = ["receive_weights"]


def receive_weights(engine: WeightSink, plan: ReshardPlan, group: Any) -> int:
    """Rollout ranks: receive every bucket of ``plan`` from ``group``'s root and load it into
    ``engine`` (one weight-update session); returns the bytes received."""
    received = 0
    engine.begin_weight_update()
    for bucket in plan.buckets:
        slots = bucket.slots
        flat = torch.empty(sum(s.numel for s in slots), dtype=plan.dtype)
        group.broadcast([flat], from_rank(0)).wait()
        received += flat.nbytes
        named, at = [], 0
        for s in slots:
            named.append((s.name, flat[at : at + s.numel].view(s.shape)))
            at += s.numel
        engine.load_weight_chunk(named)
    engine.finish_weight_update()
    return received
