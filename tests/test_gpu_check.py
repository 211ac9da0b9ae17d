"""``tools/gpu_check.py --device cpu --tiny``: the one command for the first GPU, its plumbing run
on CPU at tiny shapes (on a GPU it measures; here it must produce the same report, with the
CUDA-only figures marked as such)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.planner.residency import phases_of

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_check.py"), "--device", "cpu", "--tiny",
         "--steps", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900, env=env, check=False,
    )  # fmt: skip
    report = json.loads((out / "gpu_check.json").read_text())
    return done, report


def test_it_exits_0_and_prints_the_table(check):
    done, report = check
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for section in report["sections"]:
        assert section in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def test_the_stack_names_the_layer_spec_auto_picks(check):
    stack = check[1]["sections"]["stack"]
    assert stack["status"] == "ok" and stack["transformer_impl_auto"] == "local"
    assert stack["megatron-core"] and stack["torch"]
    assert stack["transformer_engine_imports"] is not True  # no TE here: the reason is given


def test_megatron_logits_equal_transformers(check):
    row = check[1]["sections"]["logits"]["tiny"]
    assert row["logit_scale"] > 0.1
    assert row["local_vs_hf_float32"] <= 1e-4, row


def test_the_gpu_tests_are_skipped_with_the_reason(check):
    gpu = check[1]["sections"]["gpu_tests"]
    assert gpu["status"] == "skipped" and "no CUDA" in gpu["why"]


def test_the_trainer_run_syncs_and_reports_throughput(check):
    train = check[1]["sections"]["train"]
    assert train["status"] == "ok", train.get("why")
    assert train["steps"] == 2
    assert train["logprob_diff_max"] <= 1e-4  # vLLM agrees with the actor after every sync
    assert train["sleep_levels"] == [2]
    for key in ("update_tflops", "sync_gbps", "copy_gbps", "gen_tokens_per_s"):
        assert math.isfinite(train[key]) and train[key] > 0, key
    assert train["sync_bytes"] > 0 and train["update_mfu"] is None  # no peak known on CPU


def test_the_memory_section_has_the_plans_phases(check):
    report = check[1]
    train, memory = report["sections"]["train"], report["sections"]["memory"]
    cfg = load_config([train["config"]], train["overrides"])
    assert list(memory["phases"]) == list(phases_of(cfg))
    assert all(row["measured_peak_gib"] is None for row in memory["phases"].values())
    assert "no CUDA" in memory["note"]


def test_the_overlap_run_trains_one_step_off_with_vllm_on_a_rank_of_its_own(check):
    """Step 1 generated with the synced weights (vLLM agrees with the actor), step 2 with the
    weights before step 1's update: the disaggregated path the first GPU will run, on one
    (emulated) device for its two processes, the rollout process's LOCAL_RANK mapped onto it."""
    overlap = check[1]["sections"]["overlap"]
    assert overlap["status"] == "ok", overlap.get("why")
    assert overlap["devices"] == 1 and overlap["processes"] == 2
    assert overlap["local_rank_mapped"] == "1 -> 0"
    assert overlap["steps"] == 2 and overlap["staleness"] == [0.0, 1.0]
    assert overlap["logprob_diff_first"] <= 1e-4
    assert overlap["step_s"] > 0 and overlap["sync_s"] > 0
    assert overlap["weights_link"] == "gloo"  # NCCL only between GPUs of their own
