"""Launch-environment parsing and the CPU emulation layer (no processes)."""

from __future__ import annotations

import pytest
import torch

from megarl.parallel import emulation
from megarl.parallel.init import read_launch_env
from megarl.parallel.layout import ParallelLayout


def test_torchrun_env_wins_over_slurm():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "node7",
        "MASTER_PORT": "1234",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
    }
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (3, 8, 1)
    assert (launch.master_addr, launch.master_port) == ("node7", 1234)


def test_slurm_env_without_torchrun():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "5",
        "SLURM_JOB_NODELIST": "gpu-a,gpu-b",
        "MASTER_PORT": "29600",
    }
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (5, 16, 5)
    assert launch.master_addr == "gpu-a"
    assert launch.master_port == 29600


def test_single_process_default():
    launch = read_launch_env({})
    assert (launch.rank, launch.world_size, launch.local_rank) == (0, 1, 0)


def test_model_parallel_size():
    assert ParallelLayout(2, 4, None, 2).model_parallel_size() == 16


def test_world_not_divisible_names_sizes(monkeypatch):
    from megarl.parallel.init import init_distributed

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"world size 3 .*tensor_model_parallel_size"):
        init_distributed(ParallelLayout(2, 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="emulation is CPU-only")
def test_emulation_maps_cuda_to_cpu_and_restores():
    emulation.enable_cpu_emulation()
    try:
        assert emulation.emulation_active()
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(2).to("cuda").device.type == "cpu"
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"
        assert torch.ones(2).type(torch.float64).dtype == torch.float64
        assert torch.cuda.current_device() == "cpu"
        torch.cuda.manual_seed(5)
        state = torch.cuda.get_rng_state()
        a = torch.rand(4)
        torch.cuda.set_rng_state(state)
        assert torch.equal(a, torch.rand(4))
        torch.cuda.synchronize()  # a no-op instead of "no CUDA"
    finally:
        emulation.disable_cpu_emulation()
    assert not emulation.emulation_active()
    assert torch.ones(2).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="emulation is CPU-only")
def test_device_routing_suspends_for_vllm_and_comes_back():
    """vLLM's CPU engine generates outside the mode (megarl.rollout.vllm_engine): inside the
    block a CUDA placement is torch's own error again, torch.cuda's patched names still answer,
    and the routing is back afterwards; with another mode entered after it nothing changes."""
    emulation.enable_cpu_emulation()
    try:
        with emulation.device_routing_suspended():
            with pytest.raises((AssertionError, RuntimeError)):
                torch.zeros(1, device="cuda")
            assert torch.cuda.current_device() == "cpu"
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        with torch.device("cpu"), emulation.device_routing_suspended():  # a mode on top
            assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    finally:
        emulation.disable_cpu_emulation()


def test_process_group_timeout_is_a_knob_long_enough_for_saves(monkeypatch):
    from megarl.parallel.init import DEFAULT_TIMEOUT_MINUTES, process_group_timeout_minutes

    monkeypatch.delenv("MEGARL_DIST_TIMEOUT_MINUTES", raising=False)
    assert process_group_timeout_minutes() == DEFAULT_TIMEOUT_MINUTES >= 120
    monkeypatch.setenv("MEGARL_DIST_TIMEOUT_MINUTES", "600")
    assert process_group_timeout_minutes() == 600
    monkeypatch.setenv("MEGARL_DIST_TIMEOUT_MINUTES", "0")
    with pytest.raises(ValueError, match="MEGARL_DIST_TIMEOUT_MINUTES='0'"):
        process_group_timeout_minutes()


def test_gloo_interface_is_the_one_routing_to_the_master():
    from megarl.parallel.network import route_interface, set_gloo_socket_ifname

    assert route_interface("127.0.0.1") == "lo"
    single_node = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert set_gloo_socket_ifname("127.0.0.1", single_node) is None
    assert "GLOO_SOCKET_IFNAME" not in single_node
    multi_node = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert set_gloo_socket_ifname("127.0.0.1", multi_node) == "lo"
    assert multi_node["GLOO_SOCKET_IFNAME"] == "lo"
    chosen = {**multi_node, "GLOO_SOCKET_IFNAME": "ib0"}  # the user's value wins
    assert set_gloo_socket_ifname("127.0.0.1", chosen) == "ib0"
    assert route_interface("no-such-host.invalid") is None


def test_nccl_timeout_seconds_win_over_the_variable_and_reach_the_process_group(monkeypatch):
    """``actor_rollout_ref.nccl_timeout`` is in seconds (verl's unit); given, it is the default
    group's timeout whatever $MEGARL_DIST_TIMEOUT_MINUTES says."""
    import datetime

    from megarl.parallel import init

    monkeypatch.setenv("MEGARL_DIST_TIMEOUT_MINUTES", "600")
    assert init.process_group_timeout_minutes(1800) == 30
    assert init.process_group_timeout_minutes(None) == 600
    with pytest.raises(ValueError, match="nccl_timeout=0 must be a positive number of seconds"):
        init.process_group_timeout_minutes(0)
    seen = {}
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)  # start_process_group sets them when unset
    monkeypatch.setattr(init.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(init.dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(init, "set_gloo_socket_ifname", lambda addr: None)
    init.start_process_group(read_launch_env({}), init.process_group_timeout_minutes(90))
    assert seen["timeout"] == datetime.timedelta(seconds=90)


def test_a_single_process_world_needs_no_port_and_layouts_leave_no_groups(tmp_path):
    """One process without a launcher (tests, tools): an in-memory store, so the default port
    29500, taken here on purpose when free, cannot make it fail with EADDRINUSE. In the same
    process, each new layout destroys the previous layout's process groups (Megatron's own
    teardown only forgets them): the count of groups torch knows stays the same."""
    import os
    import socket
    import subprocess
    import sys

    script = (
        "import torch, torch.distributed as dist\n"
        "from megarl.parallel.init import read_launch_env, start_process_group\n"
        "start_process_group(read_launch_env())\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\nprint(dist.get_world_size(), t.item())\n"
        "from megarl.parallel.init import destroy_distributed, init_distributed\n"
        "counts = []\n"
        "for _ in range(3):\n"
        "    init_distributed()\n"
        "    counts.append(len(dist.distributed_c10d._world.pg_map))\n"
        "print(*counts)\n"
        "destroy_distributed()\nprint(len(dist.distributed_c10d._world.pg_map))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.pop("SLURM_PROCID", None)
    try:
        taken = socket.create_server(("127.0.0.1", 29500))
    except OSError:  # already taken by another process: the same test
        taken = None
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True,
            timeout=300, check=False,
        )  # fmt: skip
    finally:
        if taken is not None:
            taken.close()
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["1", "1.0"]
    counts = [int(n) for n in lines[1].split()]
    assert counts[0] > 1 and counts == [counts[0]] * 3, counts  # the layout's groups, once
    assert lines[2] == "0"
