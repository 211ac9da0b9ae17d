"""A split launch (megarl.rollout.remote.split_world): each side its own world, groups between them,
and a rollout side that stops answering makes the training side fail in one line naming it
within the timeout (megarl.rollout.remote.engine); weight updates from the trainer's
RemoteEngine reach the rollout side's engine whole and in order, over gloo on CPU and over NCCL,
GPU to GPU, between two GPUs (megarl.rollout.remote.serve)."""

from __future__ import annotations

import time
from typing import ClassVar

import pytest

from megarl.parallel.spawn import run_local_world
from megarl.rollout.remote.split_world import distinct_devices

pytestmark = pytest.mark.multirank


def split_rank() -> dict:
    """3 ranks: 2 training, 1 rollout, each rank told it is a node of its own
    (``LOCAL_WORLD_SIZE=1``). Each side all-reduces in its own world; the bridge carries an
    object from the rollout rank; then the first training rank asks the rollout side for its EOS
    ids twice through a RemoteEngine: the rollout rank answers the first time, then stops
    answering (it sleeps)."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megarl.rollout.remote.engine import RemoteEngine, RolloutRanksLost
    from megarl.rollout.remote.split_world import broadcast_object, split_world

    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # three "nodes": gloo's interface must be chosen
    os.environ["MEGARL_EMULATED_DEVICES"] = "2"  # two GPUs for the three processes
    world = split_world(2, timeout=timedelta(seconds=3))
    t = torch.ones(1)
    dist.all_reduce(t)
    out = {"role": world.role, "side": [dist.get_rank(), dist.get_world_size(), t.item()],
           "env": [os.environ["RANK"], os.environ["WORLD_SIZE"]],
           "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
           "local_rank": os.environ["LOCAL_RANK"],
           "bridge": broadcast_object(world.bridge, "from rollout" if world.rank == 2 else None, 2)}  # fmt: skip
    channels = world.channels(nccl_weights=True)  # no GPUs here: gloo
    out["weights_device"] = None if channels is None else str(channels.weights_device)
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
    assert [r["weights_device"] for r in results] == ["cpu", None, "cpu"]


def test_on_several_nodes_gloo_uses_the_interface_routing_to_the_master(results):
    """As the colocated launch does (tests/parallel/test_init_and_emulation.py): the master is
    127.0.0.1 here, so every rank of the split launch names the loopback interface."""
    assert [r["gloo_ifname"] for r in results] == ["lo", "lo", "lo"]


def test_more_processes_than_gpus_share_them_with_local_rank_mapped(results):
    """Two (emulated) GPUs for three processes: the third takes GPU 0 and its LOCAL_RANK says
    so, as vLLM's external launcher reads it (one GPU: tools/gpu_check.py's overlap section)."""
    assert [r["local_rank"] for r in results] == ["0", "1", "0"]


def test_a_rollout_side_that_stops_answering_is_one_line_naming_it(results):
    error = results[0]["error"]
    print(error, results[0]["seconds"])
    assert error.startswith("the rollout rank(s) [2] did not answer within 3s (dead or hung)")
    assert "\n" not in error and results[0]["seconds"] < 7


def test_nccl_only_between_gpus_of_their_own():
    assert distinct_devices(["GPU-a", "GPU-b", "GPU-c"])
    assert not distinct_devices(["GPU-a", "GPU-a"])  # two ranks on one GPU: NCCL refuses
    assert not distinct_devices(["GPU-a", ""])  # a rank without a GPU


class _Sink:
    """The rollout side's engine, recording each weight-update session: per tensor its name,
    device, sum and last element."""

    eos_token_ids: ClassVar[list[int]] = [7]

    def __init__(self) -> None:
        self.sessions: list[list] = []

    def begin_weight_update(self) -> None:
        self.sessions.append([])

    def load_weight_chunk(self, named) -> None:
        self.sessions[-1] += [(n, t.device.type, t.sum().item(), t.flatten()[-1].item())
                              for n, t in named]  # fmt: skip

    def finish_weight_update(self) -> None:
        pass


def _weight(slot_index: int, shape, version: int, device):
    import torch

    start = 1000.0 * version + slot_index
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float32, device=device) + start
            ).view(shape)  # fmt: skip


def weights_rank() -> dict:
    """2 ranks: 1 training, 1 rollout. The trainer's RemoteEngine sends two weight updates of
    the tiny model (each tensor numbered by its slot and the version), as a sync at most one
    step off does; the rollout rank loads each straight into its engine (``serve`` unstaged)."""
    import torch

    from megarl.config.model_dims import ModelDims
    from megarl.models.tiny import tiny_hf_config
    from megarl.parallel.layout import ParallelLayout
    from megarl.rollout.remote.engine import RemoteEngine
    from megarl.rollout.remote.serve import serve
    from megarl.rollout.remote.split_world import split_world
    from megarl.rollout.reshard.make_plan import make_reshard_plan

    world = split_world(1)
    dims = ModelDims.from_hf_config(tiny_hf_config("qwen2", num_layers=2))
    plan = make_reshard_plan(dims, ParallelLayout(), 1, bucket_bytes=32 << 10, dtype=torch.float32)
    channels = world.channels(nccl_weights=True)
    out = {"weights_device": channels.weights_device.type, "buckets": len(plan.buckets)}
    if world.role == "rollout":
        sink = _Sink()
        serve(sink, channels, stage=False)
        return {**out, "sessions": sink.sessions}
    engine = RemoteEngine(channels, ranks=world.rollout_ranks)
    engine.bind_plan(plan)
    source = "cuda" if torch.cuda.is_available() else "cpu"  # where the trainer's tensors are
    for version in range(2):
        engine.begin_weight_update()
        first = 0  # the bucket's first slot, counting over the plan
        for bucket in plan.buckets:
            engine.load_weight_chunk([(s.name, _weight(first + i, s.shape, version, source))
                                      for i, s in enumerate(bucket.slots)])  # fmt: skip
            first += len(bucket.slots)
        engine.finish_weight_update()
    engine.shutdown()
    slots = [s for bucket in plan.buckets for s in bucket.slots]
    expected = [[(s.name, _weight(i, s.shape, v, "cpu")) for i, s in enumerate(slots)]
                for v in range(2)]  # fmt: skip
    out["expected"] = [[(n, t.sum().item(), t.flatten()[-1].item()) for n, t in session]
                       for session in expected]  # fmt: skip
    return out


def _check_weight_updates(results: list[dict], device: str) -> None:
    trainer, rollout = results
    assert trainer["buckets"] > 2  # several buckets per update
    assert trainer["weights_device"] == rollout["weights_device"] == device
    got = [[(n, total, last) for n, dev, total, last in session] for session in rollout["sessions"]]
    assert [json_round(s) for s in got] == [json_round(s) for s in trainer["expected"]]
    assert {dev for session in rollout["sessions"] for _, dev, _, _ in session} == {device}


def json_round(session: list) -> list:
    return [list(item) for item in session]


def test_weight_updates_reach_the_rollout_engine_whole_and_in_order():
    """On CPU the weights' group is gloo: the buckets go through host memory."""
    _check_weight_updates(run_local_world(weights_rank, 2), "cpu")


@pytest.mark.gpu
def test_weight_updates_go_gpu_to_gpu_over_nccl():
    """Two GPUs, one per rank: the weights' group is NCCL and the buckets arrive on the rollout
    rank's GPU (NCCL refuses two ranks on one GPU: a single-GPU machine runs gloo, as above)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    _check_weight_updates(run_local_world(weights_rank, 2), "cuda")


def staged_rank() -> dict:
    """3 ranks: 1 training, 2 rollout (one vLLM engine of TP 2). The trainer's RemoteEngine
    streams one weight update as beyond one step off (``streams``); each rollout rank receives
    its vLLM TP rank's pieces, as its weights thread does, and loads them: it reports the
    elements it staged and, per tensor, whether what the engine got is the trainer's tensor on
    exactly the part its TP rank loads, NaN elsewhere."""
    import torch

    from megarl.config.model_dims import ModelDims
    from megarl.models.tiny import tiny_hf_config
    from megarl.parallel.layout import ParallelLayout
    from megarl.rollout.remote.engine import RemoteEngine
    from megarl.rollout.remote.split_world import broadcast_object, split_world
    from megarl.rollout.remote.weights import load_buckets, receive_buckets
    from megarl.rollout.reshard.make_plan import make_reshard_plan
    from megarl.rollout.reshard.plan import slot_pieces

    world = split_world(1)
    dims = ModelDims.from_hf_config(tiny_hf_config("qwen2", num_layers=2))
    plan = make_reshard_plan(dims, ParallelLayout(), 1, bucket_bytes=32 << 10, dtype=torch.float32)
    slots = [s for bucket in plan.buckets for s in bucket.slots]
    channels = world.channels()
    if world.role == "train":
        engine = RemoteEngine(channels, ranks=world.rollout_ranks, streams=True, rollout_tp=2)
        engine.bind_plan(plan)
        engine.begin_weight_update()
        first = 0
        for bucket in plan.buckets:
            engine.load_weight_chunk([(s.name, _weight(first + i, s.shape, 0, "cpu"))
                                      for i, s in enumerate(bucket.slots)])  # fmt: skip
            first += len(bucket.slots)
        engine.finish_weight_update()
        engine.shutdown()
        return {"whole": sum(s.numel for s in slots)}
    tp_rank = world.rank - 1
    assert broadcast_object(channels.control, None, 0) == ("eos",)
    if tp_rank == 0:
        broadcast_object(channels.replies, [7], 1)
    command = broadcast_object(channels.control, None, 0)
    assert command[0] == "weights"
    flats = list(receive_buckets(command[2], channels.weights, part=(2, tp_rank)))
    sink = _WholeSink()
    load_buckets(sink, command[2], flats, part=(2, tp_rank))
    assert broadcast_object(channels.control, None, 0) == ("stop",)
    wrong = []
    for i, s in enumerate(slots):
        got, sent = sink.tensors[s.name], _weight(i, s.shape, 0, "cpu")
        expected = torch.zeros(s.shape, dtype=torch.bool)
        for piece in slot_pieces(s, dims, 2, tp_rank):
            region = expected if piece.dim is None else expected.narrow(
                piece.dim, piece.start, piece.stop - piece.start)  # fmt: skip
            region.fill_(True)
        same = torch.equal(got[expected], sent[expected])
        if not torch.equal(~got.isnan(), expected) or not same:
            wrong.append(s.name)
    return {"staged": sum(f.numel() for f in flats), "wrong": wrong}


class _WholeSink(_Sink):
    """Keeps each tensor it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict = {}

    def load_weight_chunk(self, named) -> None:
        self.tensors.update((name, t.clone()) for name, t in named)


def test_a_staged_update_holds_only_what_each_vllm_tp_rank_loads():
    """Beyond one step off each rollout rank stages about 1/TP of the model: its vLLM TP rank's
    pieces (the colocated sync's rule), the engine getting them in place and NaN elsewhere."""
    trainer, first, second = run_local_world(staged_rank, 3)
    assert first["wrong"] == second["wrong"] == []
    for rank in (first, second):  # about half (the norms whole on both; the vocabulary split
        assert trainer["whole"] * 0.45 < rank["staged"] < trainer["whole"] * 0.55  # unevenly)
    assert first["staged"] + second["staged"] > trainer["whole"]
