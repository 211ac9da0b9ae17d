"""Move prompts from the training data-parallel layout to the rollout layout and back.

Training shards prompts by its DP rank (TP/PP/CP peers hold identical shards); rollout splits the
same global batch over rollout DP groups of TP_v consecutive ranks (vLLM's external-launcher
layout), and every rank of one group must submit the identical request list. The simple, correct
scheme used here: all-gather each rank's (DP rank, prompts) over a gloo group, keep one copy per
DP rank to form the global batch (DP-rank-major), split it contiguously over rollout DP ranks,
generate, all-gather the results (one copy per rollout group) and slice out each rank's own
prompts. Object collectives pickle the data; fine for token-id lists of a rollout step.

No Megatron import: the caller passes its training DP rank and size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from megarl.rollout.base import RolloutBatch, RolloutEngine, RolloutSample

__all__ = ["even_split", "gather_global_prompts", "generate_distributed"]


def even_split(num_items: int, num_parts: int, part: int) -> range:
    """Contiguous range of items of ``part`` when ``num_items`` are split as evenly as possible
    (the first ``num_items % num_parts`` parts get one extra)."""
    if not 0 <= part < num_parts:
        raise ValueError(f"part {part} not in [0, {num_parts})")
    base, extra = divmod(num_items, num_parts)
    start = part * base + min(part, extra)
    return range(start, start + base + (part < extra))


def gather_global_prompts(
    prompts: list[list[int]],
    *,
    dp_rank: int,
    dp_size: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[list[list[int]], int]:
    """All DP shards joined in DP-rank order, and the offset of this rank's shard in it.

    Collective over ``group`` (every rank of it calls). Ranks reporting the same ``dp_rank`` must
    hold identical prompts; every DP rank in ``[0, dp_size)`` must be present.
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (dp_rank, prompts), group=group)
    shards: dict[int, list[list[int]]] = {}
    for r, shard in gathered:
        if r in shards and shards[r] != shard:
            raise ValueError(f"ranks with training DP rank {r} hold different prompt shards")
        shards[r] = shard
    if sorted(shards) != list(range(dp_size)):
        raise ValueError(f"got training DP ranks {sorted(shards)}, expected 0..{dp_size - 1}")
    offset = sum(len(shards[r]) for r in range(dp_rank))
    return [p for r in range(dp_size) for p in shards[r]], offset


def generate_distributed(
    engine: RolloutEngine,
    prompts: list[list[int]],
    *,
    dp_rank: int,
    dp_size: int,
    rollout_tp_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    **sampling: Any,
) -> RolloutBatch:
    """Generate for this rank's training-DP prompt shard on the whole rollout layout.

    Args:
        engine: the rollout engine (same on every rank).
        prompts: this rank's training-DP shard (identical on its TP/PP peers).
        dp_rank, dp_size: this rank's training DP coordinates (e.g. Megatron's DP group).
        rollout_tp_size: TP_v (default: ``engine.tensor_parallel_size``); rollout DP rank =
            rank // TP_v.
        group: a gloo group spanning all ranks (default: the default group).
        **sampling: ``n``, ``temperature``, ``max_tokens``, ``seed``, ``step``, ... as for
            ``RolloutEngine.generate``. Seeds use the prompt's position in the global batch, so
            the tokens do not depend on the rollout layout.

    Returns:
        The responses to ``prompts``, prompt-major, ``prompt_index`` relative to ``prompts``.
    """
    if rollout_tp_size is None:
        rollout_tp_size = int(engine.tensor_parallel_size)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world % rollout_tp_size:
        raise ValueError(f"rollout TP {rollout_tp_size} does not divide world size {world}")
    n = sampling["n"]
    everything, offset = gather_global_prompts(
        prompts, dp_rank=dp_rank, dp_size=dp_size, group=group
    )

    rollout_dp_size = world // rollout_tp_size
    mine = even_split(len(everything), rollout_dp_size, rank // rollout_tp_size)
    batch = engine.generate([everything[i] for i in mine], prompt_ids=list(mine), **sampling)

    # One copy per rollout group travels (its TP rank 0's); the rest send None.
    payload = (mine.start, _pack(batch)) if rank % rollout_tp_size == 0 else None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, payload, group=group)
    by_prompt: dict[int, list[tuple]] = {}
    for item in gathered:
        if item is None:
            continue
        start, rows = item
        for row in rows:
            by_prompt.setdefault(start + row[0], []).append(row)

    samples = []
    for local, global_index in enumerate(range(offset, offset + len(prompts))):
        rows = by_prompt[global_index]
        if len(rows) != n:
            raise RuntimeError(f"prompt {global_index}: {len(rows)} responses, expected {n}")
        samples.extend(_unpack(row, local) for row in sorted(rows, key=lambda r: r[1]))
    return RolloutBatch(samples, n)


def _pack(batch: RolloutBatch) -> list[tuple]:
    return [
        (
            s.prompt_index,
            s.sample_index,
            s.prompt_token_ids,
            s.response_token_ids,
            s.response_logprobs,
            s.finish_reason,
        )
        for s in batch
    ]


def _unpack(row: Sequence[Any], prompt_index: int) -> RolloutSample:
    _, sample_index, prompt_ids, response_ids, logprobs, finish = row
    return RolloutSample(prompt_index, sample_index, prompt_ids, response_ids, logprobs, finish)
