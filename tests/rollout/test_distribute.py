"""Prompt redistribution (training DP layout → rollout DP groups → back) with a fake engine.

No vLLM: 4 gloo ranks (torch.multiprocessing) run every combination of rollout layout (replicas
of 1, 2, 4 consecutive ranks, and interleaved replicas as ActorEngine has with PP) and training
layout in one launch; the fake engine answers with the global prompt id it was asked about. The
same launch checks the rollout ranks' side of a split launch (one request on every rank).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.rollout.base import RolloutBatch, RolloutSample, request_seed
from megarl.rollout.distribute import even_split

WORLD = 4


@pytest.mark.parametrize("num_items", [0, 1, 3, 7, 8])
@pytest.mark.parametrize("num_parts", [1, 2, 4])
def test_even_split_covers_everything_once(num_items, num_parts):
    parts = [even_split(num_items, num_parts, p) for p in range(num_parts)]
    assert [i for r in parts for i in r] == list(range(num_items))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_request_seed_is_stable_and_distinct():
    # Pinned values: every process (any PYTHONHASHSEED, any rank) must draw these exact seeds.
    assert request_seed(1, 2, 3, 4) == 247016712404102169
    assert request_seed(0, 0, 0, 0) == 3454979278824678080
    seeds = {request_seed(0, step, p, s) for step in range(3) for p in range(20) for s in range(4)}
    assert len(seeds) == 3 * 20 * 4
    assert all(0 <= x < 2**62 for x in seeds)


def test_rollout_batch_padding_and_order():
    batch = RolloutBatch(
        [
            RolloutSample(0, 0, [1], [5, 6, 7], [-0.1, -0.2, -0.3], "length", prompt_id=7),
            RolloutSample(0, 1, [1], [8], [-0.4], "stop", prompt_id=7),
        ],
        n=2,
    )
    batch.check_order()
    assert batch.prompt_ids.tolist() == [7, 7]
    ids, logprobs, mask = batch.padded_responses(pad_token_id=-1)
    assert ids.tolist() == [[5, 6, 7], [8, -1, -1]]
    assert mask.tolist() == [[True] * 3, [True, False, False]]
    assert logprobs[1, 0].item() == pytest.approx(-0.4)
    with pytest.raises(ValueError):
        RolloutSample(0, 0, [1], [5], [], "stop", prompt_id=0)
    with pytest.raises(TypeError):  # every sample carries its global prompt id
        RolloutSample(0, 0, [1], [5], [-0.1], "stop")  # type: ignore[call-arg]
    batch.samples[1].prompt_id = 8
    with pytest.raises(ValueError, match="prompt_id"):
        batch.check_order()


class FakeEngine:
    """Answers prompt p, sample s with tokens [global id of p, s]; remembers what it was asked."""

    def __init__(self, dp_rank: int, dp_size: int) -> None:
        self.tensor_parallel_size = 4 // dp_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.calls: list[tuple] = []

    def generate(self, prompts, *, n, prompt_ids=None, seed, step=0, **kw) -> RolloutBatch:
        prompt_ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
        self.calls.append((prompts, prompt_ids))
        self.images = kw.get("images")
        samples = [
            RolloutSample(
                p,
                s,
                prompts[p],
                [prompt_ids[p], s],
                [-1.0, -2.0],
                "length",
                prompt_id=prompt_ids[p],
            )
            for p in range(len(prompts))
            for s in range(n)
        ]
        return RolloutBatch(samples, n)


# Rollout replica of each rank and their number: vLLM-like groups of 1, 2, 4 consecutive ranks,
# and interleaved replicas {0, 2}, {1, 3} (ActorEngine: Megatron DP with PP 2).
ROLLOUT_LAYOUTS = [
    ("tp_v1", lambda r: r, 4),
    ("tp_v2", lambda r: r // 2, 2),
    ("tp_v4", lambda r: 0, 1),
    ("interleaved", lambda r: r % 2, 2),
]


def _check_layouts(rank: int, store: str) -> None:
    # a file store: no port to pick and lose to another process before it is bound (issue 53)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    from megarl.rollout.distribute import generate_distributed

    n = 3
    for num_prompts in (7, 3):  # uneven; 3 prompts leave one training DP rank empty
        prompts = [[100 + i, i] for i in range(num_prompts)]
        # (training DP rank of each global rank, DP size): Megatron-like blocks, interleaved, one
        for dp_of, dp_size in [
            (lambda r: r, 4),
            (lambda r: r // 2, 2),
            (lambda r: r % 2, 2),
            (lambda r: 0, 1),
        ]:
            dp_rank = dp_of(rank)
            shard_range = even_split(num_prompts, dp_size, dp_rank)
            local = [prompts[i] for i in shard_range]
            for name, replica_of, replicas in ROLLOUT_LAYOUTS:
                engine = FakeEngine(replica_of(rank), replicas)
                batch = generate_distributed(
                    engine,
                    local,
                    dp_rank=dp_rank,
                    dp_size=dp_size,
                    n=n,
                    temperature=1.0,
                    max_tokens=2,
                    seed=0,
                )
                where = f"rank {rank} prompts {num_prompts} dp {dp_size} rollout {name}"
                batch.check_order()
                assert len(batch) == n * len(local), where
                for i, s in enumerate(batch):
                    assert s.prompt_token_ids == local[i // n], where
                    assert s.response_token_ids == [shard_range[i // n], i % n], where
                    assert s.prompt_id == shard_range[i // n], where
                assert batch.prompt_ids.tolist() == [shard_range[i // n] for i in range(len(batch))]
                # Every rank of a replica was asked the same; replicas cover all prompts in order.
                calls: list = [None] * WORLD
                dist.all_gather_object(calls, (replica_of(rank), engine.calls[0]))
                asked_by = {}
                for replica, call in calls:
                    assert asked_by.setdefault(replica, call) == call, where
                asked = [pid for r in range(replicas) for pid in asked_by[r][1]]
                assert asked == list(range(num_prompts)), where
        _check_replicas(rank, prompts, n)
        _check_images(rank, prompts, n)
    dist.destroy_process_group()


def _check_images(rank: int, prompts: list[list[int]], n: int) -> None:
    """A VL engine's images (every rank holding the whole batch, as the trainer's): each
    replica is given its share's images beside its prompts; a DP-sharded batch is refused."""
    from megarl.rollout.distribute import generate_distributed

    images = [[f"image {i}"] if i % 2 else None for i in range(len(prompts))]
    for name, replica_of, replicas in ROLLOUT_LAYOUTS:
        engine = FakeEngine(replica_of(rank), replicas)
        batch = generate_distributed(engine, prompts, dp_rank=0, dp_size=1, n=n, seed=0,
                                     images=images)  # fmt: skip
        assert len(batch) == n * len(prompts)
        mine = even_split(len(prompts), replicas, replica_of(rank))
        assert engine.images == [images[i] for i in mine], f"rank {rank} rollout {name}"
    with pytest.raises(ValueError, match="dp_size=2"):
        generate_distributed(FakeEngine(0, 1), prompts[:1], dp_rank=rank % 2, dp_size=2, n=1,
                             seed=0, images=[None])  # fmt: skip


def _check_replicas(rank: int, prompts: list[list[int]], n: int) -> None:
    """The rollout ranks' side of a split launch: every rank holds the whole request, with the
    trainer's prompt ids; each replica generates its share, every rank gets the whole batch."""
    from megarl.rollout.distribute import generate_on_replicas

    ids = [50 - 3 * i for i in range(len(prompts))]  # any distinct ids, kept and seeding
    for name, replica_of, replicas in ROLLOUT_LAYOUTS:
        engine = FakeEngine(replica_of(rank), replicas)
        batch = generate_on_replicas(
            engine, prompts, prompt_ids=ids, n=n, temperature=1.0, max_tokens=2, seed=0
        )
        where = f"rank {rank} prompts {len(prompts)} rollout {name}"
        batch.check_order()
        assert [(s.prompt_index, s.prompt_id, s.sample_index) for s in batch] == [
            (p, ids[p], s) for p in range(len(prompts)) for s in range(n)
        ], where
        assert [s.response_token_ids for s in batch] == [
            [ids[p], s] for p in range(len(prompts)) for s in range(n)
        ], where
        mine = even_split(len(prompts), replicas, replica_of(rank))
        assert engine.calls == [([prompts[i] for i in mine], [ids[i] for i in mine])], where
    with pytest.raises(ValueError, match="distinct prompt_ids"):
        generate_on_replicas(FakeEngine(0, 1), prompts[:2], prompt_ids=[1, 1], n=1, seed=0)


@pytest.mark.multirank
def test_generate_distributed_all_layouts(tmp_path):
    """Each rank gets its own prompts back with their global prompt ids, at every training and
    rollout layout (incl. rollout DP 2 and 4); rollout ranks holding one request alike get the
    whole batch back from their replicas (generate_on_replicas); a VL engine's images reach
    each replica with its share of the prompts."""
    mp.spawn(_check_layouts, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)


def test_object_collectives_use_gloo_when_the_default_group_is_not(tmp_path, monkeypatch):
    """A one-rank gloo world standing in for NCCL: the object group is a cached gloo group."""
    from megarl.rollout import distribute

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        assert distribute.object_group() is None  # the default group is gloo already
        monkeypatch.setattr(distribute.dist, "get_backend", lambda group=None: "nccl")
        group = distribute.object_group()
        assert group is not None
        assert dist.distributed_c10d.get_backend(group) == "gloo"
        assert distribute.object_group() is group  # created once
        given = object()
        assert distribute.object_group(given) is given
        everything, offset = distribute.gather_global_prompts([[1, 2]], dp_rank=0, dp_size=1)
        assert (everything, offset) == ([[1, 2]], 0)
    finally:
        distribute._GLOO_WORLD.clear()
        dist.destroy_process_group()
