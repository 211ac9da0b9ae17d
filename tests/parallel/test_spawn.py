"""The local world launcher: ranks that all-reduce and return, a failing rank, a dying rank."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import psutil
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


def rank_leaving_an_orphan(marker_dir: str) -> None:
    """Start a helper and orphan it (as a checkpoint writer outliving its parent would be);
    then rank 1 fails while rank 0 waits."""
    out = subprocess.run(
        ["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"],
        check=True,
        capture_output=True,
        text=True,
    )
    Path(marker_dir, f"rank{os.environ['RANK']}").write_text(out.stdout.strip())
    if os.environ["RANK"] == "1":
        raise ValueError("boom")
    time.sleep(300)


def dying_rank() -> None:
    if os.environ["RANK"] == "1":
        os._exit(3)
    time.sleep(300)


@pytest.mark.multirank
def test_two_ranks_all_reduce_and_return_in_rank_order():
    assert run_local_world(all_reduce_rank, 2, (10.0,)) == [[0, 2, 30.0], [1, 2, 30.0]]


@pytest.mark.multirank
def test_a_rendezvous_port_taken_after_the_pick_starts_the_world_again(monkeypatch):
    """Another process takes the picked port before rank 0 binds it (here: this test, on
    purpose): the world starts again on a new port."""
    from megarl.parallel import spawn

    picks = []
    with socket.create_server(("127.0.0.1", 0)) as taken:
        real = spawn.free_port

        def pick(host="127.0.0.1"):
            picks.append(taken.getsockname()[1] if not picks else real(host))
            return picks[-1]

        monkeypatch.setattr(spawn, "free_port", pick)
        # one rank: its store's bind is what the pick races with (two would only cost more)
        assert run_local_world(all_reduce_rank, 1, (10.0,)) == [[0, 1, 10.0]]
    assert len(picks) == 2 and picks[0] != picks[1]


def test_a_failing_rank_stops_the_world_with_its_one_line_error():
    # (rank 0 is stopped, not left in its all-reduce: otherwise this never returns)
    with pytest.raises(WorkerError) as info:
        run_local_world(failing_rank, 2)
    assert str(info.value) == "rank 1: ValueError: shard 1 is corrupted"
    assert info.value.rank == 1 and info.value.error_type == "ValueError"
    assert "failing_rank" in info.value.traceback


@pytest.mark.multirank
def test_processes_a_rank_started_are_stopped_with_it_even_orphaned(tmp_path: Path):
    with pytest.raises(WorkerError, match="^rank 1: ValueError: boom$"):
        run_local_world(rank_leaving_an_orphan, 2, (str(tmp_path),))
    helpers = [int(f.read_text()) for f in tmp_path.iterdir()]
    assert helpers  # rank 1's at least (rank 0 may have been stopped before it made one)
    assert not running(helpers, within_s=10)


def running(pids: list[int], within_s: float) -> list[int]:
    """Those of ``pids`` still running (not ended, not a zombie) after up to ``within_s``."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=within_s)
    left = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return left


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
