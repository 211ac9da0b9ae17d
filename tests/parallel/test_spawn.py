"""The local world launcher: ranks that all-reduce and return, a failing rank, a dying rank."""

from __future__ import annotations

import os
import time

import pytest

from megarl.parallel.spawn import WorkerError, inside_launched_world, run_local_world

# Rank bodies: top-level functions, because spawned ranks re-import them by name.


def all_reduce_rank(scale: float) -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([scale * (dist.get_rank() + 1)])
    dist.all_reduce(t)
    out = (dist.get_rank(), dist.get_world_size(), t.item())
    dist.destroy_process_group()
    return out


def failing_rank() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("shard 1 is corrupted\nsecond line")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes


def dying_rank() -> None:
    if os.environ["RANK"] == "1":
        os._exit(3)
    time.sleep(300)


@pytest.mark.multirank
def test_two_ranks_all_reduce_and_return_in_rank_order():
    assert run_local_world(all_reduce_rank, 2, (10.0,)) == [[0, 2, 30.0], [1, 2, 30.0]]


@pytest.mark.multirank
def test_a_failing_rank_stops_the_world_with_its_one_line_error():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_local_world(failing_rank, 2)
    assert str(info.value) == "rank 1: ValueError: shard 1 is corrupted"
    assert info.value.rank == 1 and info.value.error_type == "ValueError"
    assert "failing_rank" in info.value.traceback
    assert time.monotonic() - start < 120  # rank 0 was stopped, not left in its all-reduce


@pytest.mark.multirank
def test_a_rank_dying_without_a_result_stops_the_world():
    with pytest.raises(WorkerError, match=r"^rank 1 exited with code 3 without a result$"):
        run_local_world(dying_rank, 2)


def test_inside_launched_world(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert not inside_launched_world()
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task srun step: not a world to join
    assert not inside_launched_world()
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert inside_launched_world()
    monkeypatch.delenv("SLURM_PROCID")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert inside_launched_world()
