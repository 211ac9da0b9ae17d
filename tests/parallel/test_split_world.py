"""A split launch (megarl.parallel.split_world): each side its own world, groups between them,
and a rollout side that stops answering makes the training side fail in one line naming it
within the timeout (megarl.rollout.remote_engine)."""

from __future__ import annotations

import time

import pytest

from megarl.parallel.spawn import run_local_world

pytestmark = pytest.mark.multirank


def split_rank() -> dict:
    """3 ranks: 2 training, 1 rollout. Each side all-reduces in its own world; the bridge
    carries an object from the rollout rank; then the first training rank asks the rollout side
    for its EOS ids twice through a RemoteEngine: the rollout rank answers the first time, then
    stops answering (it sleeps)."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megarl.parallel.split_world import broadcast_object, split_world
    from megarl.rollout.remote_engine import RemoteEngine, RolloutRanksLost

    world = split_world(2, timeout=timedelta(seconds=3))
    t = torch.ones(1)
    dist.all_reduce(t)
    out = {"role": world.role, "side": [dist.get_rank(), dist.get_world_size(), t.item()],
           "env": [os.environ["RANK"], os.environ["WORLD_SIZE"]],
           "bridge": broadcast_object(world.bridge, "from rollout" if world.rank == 2 else None, 2)}  # fmt: skip
    channels = world.channels()
    if world.role == "rollout":
        assert broadcast_object(channels.control, None, 0) == ("eos",)
        broadcast_object(channels.replies, [7], 1)
        time.sleep(8)
        return out
    out["eos"] = RemoteEngine(channels, ranks=world.rollout_ranks, timeout="3s").eos_token_ids
    start = time.perf_counter()
    try:
        RemoteEngine(channels, ranks=world.rollout_ranks, timeout="3s")
    except RolloutRanksLost as exc:
        out["error"] = str(exc)
    except RuntimeError as exc:  # the other training rank: its wait for the first one timed out
        out["peer_error"] = type(exc).__name__
    out["seconds"] = time.perf_counter() - start
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_local_world(split_rank, 3)


def test_each_side_has_its_own_world_and_the_bridge_joins_them(results):
    assert [r["role"] for r in results] == ["train", "train", "rollout"]
    assert [r["side"] for r in results] == [[0, 2, 2.0], [1, 2, 2.0], [0, 1, 1.0]]
    assert [r["env"] for r in results] == [["0", "2"], ["1", "2"], ["0", "1"]]
    assert {r["bridge"] for r in results} == {"from rollout"}
    assert results[0]["eos"] == results[1]["eos"] == [7]


def test_a_rollout_side_that_stops_answering_is_one_line_naming_it(results):
    error = results[0]["error"]
    print(error, results[0]["seconds"])
    assert error.startswith("the rollout rank(s) [2] did not answer within 3s (dead or hung)")
    assert "\n" not in error and results[0]["seconds"] < 7
