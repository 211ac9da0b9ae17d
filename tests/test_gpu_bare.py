"""``tools/gpu_check.py --bare-node --device cpu --tiny``: the check for a GPU node as it comes
(no vLLM, TE or network; tools/gpu_bare.py), its plumbing on CPU at tiny shapes: every section
runs and reports, the weight sync is exact and its bytes are the plan's, GRPO with LoRA trains,
PPO resumes from its checkpoint; the CUDA-only figures are None. Also the bare-node command of
docs/gpu.md fits the device tool's 2000 characters, and ``make gpu-carry`` names what it
installs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_bare")
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_check.py"), "--bare-node", "--device", "cpu",
         "--tiny", "--steps", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    return done, json.loads((out / "gpu_check.json").read_text()), out


def test_every_section_reports_and_it_exits_0(bare):
    done, report, out = bare
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["mode"] == "bare-node"
    assert list(report["sections"]) == ["stack", "gpu_tests", "reshard", "grpo_lora", "ppo_resume"]
    assert report["sections"]["gpu_tests"]["status"] == "skipped"  # no CUDA here
    table = (out / "gpu_check.txt").read_text()
    assert all(name in table for name in report["sections"]) and table in done.stdout


def test_the_sync_is_exact_and_moves_the_plans_bytes(bare):
    sync = bare[1]["sections"]["reshard"]
    assert sync["status"] == "ok", sync
    assert sync["mismatched"] == [] and sync["not_received"] == [] and sync["tensors"] > 0
    assert sync["bytes"] == sync["plan_bytes"] > 0
    assert sync["buffer_bytes"] == sync["plan_buffer_bytes"] >= sync["bytes"]  # vocab padding
    assert sync["sync_gbps"] > 0 and sync["copy_gbps"] > 0


def test_grpo_with_lora_trains_and_each_phase_has_the_plans_figure(bare):
    run = bare[1]["sections"]["grpo_lora"]
    assert run["status"] == "ok", run.get("why")
    assert run["launches"][0]["steps"] == [1]
    assert run["timing_s"]["update_actor"] > 0 and run["timing_s"]["gen"] > 0
    phases = run["memory"]["phases"]
    assert {"generate", "update_actor", "sync"} <= set(phases)
    assert all(row["planned_gib"] >= 0 and row["measured_peak_gib"] is None
               for row in phases.values())  # fmt: skip


def test_ppo_resumes_from_its_checkpoint(bare):
    run = bare[1]["sections"]["ppo_resume"]
    assert run["status"] == "ok", run.get("why")
    assert [launch["steps"] for launch in run["launches"]] == [[1], [2]]
    assert run["resumed_from"] and run["resumed_from"].rstrip("/").endswith("global_step_1")
    assert run["checkpoint_gib"] > 0 and run["save_s"] is not None


def test_the_documented_bare_node_command_fits_the_device_tool():
    text = (REPO / "docs" / "gpu.md").read_text()
    block = re.search(r"<!-- bare-node command -->\n```\n(.*?)\n```", text, re.DOTALL)
    assert block, "docs/gpu.md lost its bare-node command block"
    command = block.group(1)
    assert len(command) <= 2000 and "--bare-node" in command and ".whl/" in command
    makefile = (REPO / "Makefile").read_text()
    assert "gpu-carry:" in makefile and "megatron-core==0.16.1" in makefile
