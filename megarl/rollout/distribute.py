"""Move prompts from the training data-parallel layout to the rollout layout and back.

Training shards prompts by its DP rank (TP/PP/CP peers hold identical shards); rollout splits
the same global batch over the engine's replicas (``engine.dp_rank``), and every rank of one
replica must submit the identical request list. So: all-gather each rank's (DP rank, prompts),
keep one copy per DP rank to form the global batch (DP-rank-major), split it contiguously over
the replicas, generate, all-gather the results (one copy per replica) and slice out each rank's
own prompts. Prompts keep their global ids, which seed them, so the tokens do not depend on the
rollout layout. Object collectives run over gloo (:func:`object_group`). No Megatron import:
the caller passes its training DP rank and size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from megarl.parallel.collectives import _GLOO_WORLD, object_group  # noqa: F401 -- re-exported
from megarl.rollout.base import RolloutBatch, RolloutEngine, RolloutSample

__all__ = [
    "even_split",
    "gather_from_replicas",
    "gather_global_prompts",
    "generate_distributed",
    "generate_on_replicas",
    "in_order",
    "object_group",
    "replica_share",
]


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

    Collective over ``group`` (every rank of it calls; None: :func:`object_group`). Ranks
    reporting the same ``dp_rank`` must hold identical prompts; every DP rank in
    ``[0, dp_size)`` must be present.
    """
    group = object_group(group)
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
    group: dist.ProcessGroup | None = None,
    images: Sequence[Any] | None = None,
    **sampling: Any,
) -> RolloutBatch:
    """Generate for this rank's training-DP prompt shard on the whole rollout layout.

    Args:
        engine: the rollout engine (same on every rank); its ``dp_rank``/``dp_size`` say which
            ranks form one rollout replica (vLLM: ``rank // TP_v``; ``ActorEngine``: Megatron's
            DP replicas).
        prompts: this rank's training-DP shard (identical on its TP/PP peers).
        dp_rank, dp_size: this rank's training DP coordinates (e.g. Megatron's DP group).
        group: a gloo group spanning all ranks (default: :func:`object_group`).
        images: a VL engine's images of each prompt (``VLLMEngine.generate``'s ``images``),
            only where every rank holds the whole batch (``dp_size`` 1): the images stay on
            their rank, each replica taking its share of them beside its prompts.
        **sampling: ``n``, ``temperature``, ``max_tokens``, ``seed``, ``step``, ... as for
            ``RolloutEngine.generate`` (not ``prompt_ids``: they are the global positions).

    Returns:
        The responses to ``prompts``, prompt-major; ``prompt_index`` is relative to ``prompts``
        and ``prompt_id`` is the prompt's position in the global batch (all training-DP shards
        joined in DP-rank order), which also seeded it, so tokens do not depend on the rollout
        layout. ``batch.prompt_ids`` gives them as a tensor.
    """
    if "prompt_ids" in sampling:
        raise TypeError("generate_distributed assigns prompt_ids itself (global positions)")
    if images is not None and (dp_size != 1 or len(images) != len(prompts)):
        raise ValueError(
            f"images travel with the prompts only where every rank holds the whole batch "
            f"(dp_size 1, one entry a prompt): dp_size={dp_size}, {len(images)} image lists for "
            f"{len(prompts)} prompts"
        )
    group = object_group(group)
    everything, offset = gather_global_prompts(
        prompts, dp_rank=dp_rank, dp_size=dp_size, group=group
    )
    rows = _generate_on_replicas(
        engine, everything, range(len(everything)), group, sampling, images=images
    )
    return in_order(rows, range(offset, offset + len(prompts)), sampling["n"])


def generate_on_replicas(
    engine: RolloutEngine,
    prompts: list[list[int]],
    *,
    prompt_ids: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    **sampling: Any,
) -> RolloutBatch:
    """Generate ``prompts``, which every rank of ``group`` holds alike, split over the engine's
    rollout replicas; the whole batch comes back on every rank (collective over ``group``,
    default :func:`object_group`). The rollout ranks of a split launch serve the trainer's
    requests so (:func:`megarl.rollout.remote.serve.serve`).

    ``prompt_ids`` (default ``0..len(prompts)-1``, distinct) seed the responses as in
    ``RolloutEngine.generate``, so the tokens do not depend on how many replicas there are. The
    batch is prompt-major with ``prompt_index`` relative to ``prompts``.
    """
    ids = list(range(len(prompts)) if prompt_ids is None else prompt_ids)
    if len(ids) != len(prompts) or len(set(ids)) != len(ids):
        raise ValueError(f"{len(prompts)} prompts need as many distinct prompt_ids, got {ids}")
    rows = _generate_on_replicas(engine, prompts, ids, object_group(group), sampling)
    return in_order(rows, ids, sampling["n"])


def _generate_on_replicas(
    engine: RolloutEngine,
    prompts: list[list[int]],
    ids: Sequence[int],
    group: dist.ProcessGroup | None,
    sampling: dict[str, Any],
    images: Sequence[Any] | None = None,
) -> dict[int, list[tuple]]:
    """Each replica generates its contiguous share of ``prompts`` (and of their ``images``, a
    VL engine's, held alike on every rank); every rank gets every replica's responses, packed
    rows by prompt id."""
    mine, my_ids = replica_share(engine, prompts, ids)
    if images is not None:
        share = even_split(len(prompts), engine.dp_size, engine.dp_rank)
        sampling = {**sampling, "images": [images[i] for i in share]}
    return gather_from_replicas(engine, engine.generate(mine, prompt_ids=my_ids, **sampling), group)


def replica_share(
    engine: RolloutEngine, prompts: list[list[int]], ids: Sequence[int]
) -> tuple[list[list[int]], list[int]]:
    """This rank's replica's contiguous share of ``prompts`` and of their ``ids``."""
    mine = even_split(len(prompts), engine.dp_size, engine.dp_rank)
    return [prompts[i] for i in mine], [ids[i] for i in mine]


def gather_from_replicas(
    engine: RolloutEngine, batch: RolloutBatch, group: dist.ProcessGroup | None
) -> dict[int, list[tuple]]:
    """Every replica's ``batch`` of its :func:`replica_share`, on every rank of ``group``
    (collective): packed rows by prompt id, for :func:`in_order`."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    reporter = _replica_reporter(engine, world, rank, group)
    # One copy per rollout replica travels (its lowest rank's); the rest send None.
    payload = _pack(batch) if reporter == rank else None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, payload, group=group)
    by_prompt: dict[int, list[tuple]] = {}
    for rows in gathered:
        for row in rows or []:
            by_prompt.setdefault(row[0], []).append(row)
    return by_prompt


def in_order(by_prompt: dict[int, list[tuple]], ids: Sequence[int], n: int) -> RolloutBatch:
    """The responses to the prompts ``ids``, prompt-major, each ``n`` of them."""
    samples = []
    for local, prompt_id in enumerate(ids):
        rows = by_prompt.get(prompt_id, [])
        if len(rows) != n:
            raise RuntimeError(f"prompt {prompt_id}: {len(rows)} responses, expected {n}")
        samples.extend(_unpack(row, local) for row in sorted(rows, key=lambda r: r[1]))
    return RolloutBatch(samples, n)


def _replica_reporter(
    engine: RolloutEngine, world: int, rank: int, group: dist.ProcessGroup | None
) -> int:
    """The rank (in ``group``) that reports this rank's replica's results: its lowest rank.
    Checks that the engine's replicas cover ``0..dp_size-1``."""
    replicas: list[Any] = [None] * world
    dist.all_gather_object(replicas, (int(engine.dp_rank), int(engine.dp_size)), group=group)
    sizes = {size for _, size in replicas}
    ranks_of = {r for r, _ in replicas}
    if len(sizes) != 1 or ranks_of != set(range(engine.dp_size)):
        raise ValueError(f"rollout replicas (dp_rank, dp_size) per rank {replicas} are not 0..n-1")
    return replicas.index((engine.dp_rank, engine.dp_size))


def _pack(batch: RolloutBatch) -> list[tuple]:
    return [
        (
            s.prompt_id,
            s.sample_index,
            s.prompt_token_ids,
            s.response_token_ids,
            s.response_logprobs,
            s.finish_reason,
            s.routing,
            s.token_versions,
        )
        for s in batch
    ]


def _unpack(row: Sequence[Any], prompt_index: int) -> RolloutSample:
    prompt_id, sample_index, prompt_tokens, response_ids, logprobs, finish, routing, versions = row
    return RolloutSample(
        prompt_index,
        sample_index,
        prompt_tokens,
        response_ids,
        logprobs,
        finish,
        prompt_id=prompt_id,
        routing=routing,
        token_versions=versions,
    )
