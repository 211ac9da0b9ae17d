"""Weight updates from the training ranks to vLLM on rollout ranks of their own.

The training ranks run the resharding plan into a
:class:`~megarl.rollout.remote.engine.RemoteEngine`; the plan is made for vLLM TP 1, so whole
HF tensors reach the first training rank (the others drop theirs), which sends each bucket on
the ``weights`` group. Each rollout rank loads the buckets, in plan order, in one weight-update
session between two requests: straight in as they arrive (at most one step off; whole buckets
broadcast to every rollout rank, over NCCL where every member has a GPU of its own, else gloo),
or staged (beyond one step off; received into host memory while the engine generates, each
rank sent only its vLLM TP rank's pieces, :func:`pack_part`). The plan travels with the
``weights`` command, so the rollout side needs no Megatron.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megarl.rollout.base import WeightSink
from megarl.rollout.remote.split_world import HOST, from_rank
from megarl.rollout.reshard.executor import piece_of, slot_view, unpack_pieces
from megarl.rollout.reshard.plan import Bucket, ReshardPlan, SlicePiece, slot_pieces

__all__ = ["load_buckets", "pack_part", "part_pieces", "receive_buckets"]

Part = tuple[int, int]
"""``(rollout TP, vLLM TP rank)``: the pieces one rollout rank receives of each bucket."""


def part_pieces(plan: ReshardPlan, bucket: Bucket, part: Part) -> list[SlicePiece]:
    """What the vLLM TP rank of ``part`` loads of ``bucket``, in slot order."""
    tp, rank = part
    return [piece for s in bucket.slots for piece in slot_pieces(s, plan.dims, tp, rank)]


def pack_part(
    plan: ReshardPlan, bucket: Bucket, tensors: list[torch.Tensor], part: Part
) -> torch.Tensor:
    """Training side: the pieces of ``part`` of the bucket's whole HF ``tensors`` (in slot
    order), back to back."""
    whole = {slot.name: t for slot, t in zip(bucket.slots, tensors, strict=True)}
    views = [piece_of(whole[p.slot.name], p).reshape(-1) for p in part_pieces(plan, bucket, part)]
    return torch.cat(views) if views else torch.empty(0, dtype=plan.dtype)


def receive_buckets(
    plan: ReshardPlan, group: Any, device: torch.device = HOST, *, part: Part | None = None
) -> Iterator[torch.Tensor]:
    """Rollout ranks: every bucket of ``plan`` from ``group``'s root, in plan order (each its
    HF tensors back to back, on ``device``), each received when the caller asks for it. With
    ``part``: only its pieces (:func:`pack_part`), sent to this rank alone (nothing when they
    are empty: a vocabulary shard of vLLM's padding rows only)."""
    for bucket in plan.buckets:
        if part is None:
            flat = torch.empty(sum(s.numel for s in bucket.slots), dtype=plan.dtype, device=device)
            group.broadcast([flat], from_rank(0)).wait()
        else:
            numel = sum(p.numel for p in part_pieces(plan, bucket, part))
            flat = torch.empty(numel, dtype=plan.dtype, device=device)
            if numel:
                group.recv([flat], 0, 0).wait()
        yield flat
        del flat  # before the next one is allocated (one bucket on the device at a time)


def load_buckets(
    engine: WeightSink,
    plan: ReshardPlan,
    flats: Iterable[torch.Tensor],
    *,
    part: Part | None = None,
) -> None:
    """Load ``plan``'s buckets into ``engine``, in one weight-update session: from a staged list,
    or straight from :func:`receive_buckets` (each bucket loaded as it comes in). With ``part``
    the buckets hold its pieces only: each tensor goes in whole-shaped, NaN elsewhere (at TP 1
    the pieces are the whole tensors: they go in as they are)."""
    engine.begin_weight_update()
    for bucket, flat in zip(plan.buckets, flats, strict=True):
        named, at = [], 0
        if part is None or part[0] == 1:
            for s in bucket.slots:
                named.append((s.name, flat[at : at + s.numel].view(s.shape)))
                at += s.numel
        else:  # the bucket's buffer as the colocated sync lays it out, NaN where nothing came
            full = torch.full((bucket.numel,), float("nan"), dtype=flat.dtype, device=flat.device)
            unpack_pieces(flat, part_pieces(plan, bucket, part), full)
            named = [(s.name, slot_view(full, s)) for s in bucket.slots]
            del full
        engine.load_weight_chunk(named)
        del flat, named  # before the next bucket comes in
    engine.finish_weight_update()
