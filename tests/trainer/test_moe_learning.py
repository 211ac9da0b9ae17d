"""The tiny Qwen3-MoE learns under ``megarl train`` at EP 2, and its checkpoint resumes at EP 1.

Two real runs through the quickstart (2 ranks, vLLM TP 2, the synthetic task,
``configs/grpo_moe_tiny_cpu.yaml``, routing replay R2): 6 steps at actor TP 1 × EP 2 with greedy
validation at steps 0 and 5 and a checkpoint at step 5; then, from a copy of that checkpoint,
step 6 at EP 1 (every rank holds all 8 experts), validating the loaded weights first. The
second run is the control of the first: greedy validation of the same weights must give the
same score (so the learning threshold is the dense run's 0.15, 3σ being 0), and its step 6 must
be the first run's step 6 (the same prompts, rollouts and update, to the rounding of another expert layout).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._run_outputs import read_metrics, rollout_prompts

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "grpo_moe_tiny_cpu.yaml"
MEG = "actor_rollout_ref.actor.megatron"
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multirank]


def _quickstart(out: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megarl.commands.quickstart", "--out", str(out),
         "--config", str(CONFIG), "--family", "qwen3_moe",
         f"trainer.default_local_dir={run_dir}", f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
         *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    main_dir, resumed_dir = out / "runs" / "ep2", out / "runs" / "ep1"
    main = _quickstart(
        out, main_dir, "trainer.total_training_steps=6", "trainer.test_freq=5",
        "trainer.save_freq=5",
    )  # fmt: skip
    assert main.returncode == 0, main.stdout[-3000:] + main.stderr[-5000:]
    shutil.copytree(main_dir / "global_step_5", resumed_dir / "global_step_5")
    (resumed_dir / "latest_checkpointed_iteration.txt").write_text("5\n")
    resumed = _quickstart(
        out, resumed_dir, "trainer.total_training_steps=6", "trainer.test_freq=-1",
        "trainer.save_freq=-1", f"{MEG}.expert_model_parallel_size=1",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert f"resumed from {resumed_dir / 'global_step_5'}" in resumed.stdout + resumed.stderr
    return {"main": read_metrics(main_dir), "resumed": read_metrics(resumed_dir),
            "main_dir": main_dir, "resumed_dir": resumed_dir}  # fmt: skip


def test_moe_greedy_validation_rises(runs):
    main, resumed = runs["main"], runs["resumed"]
    r0, r5 = (main[s]["val/score/mean"] for s in (0, 5))
    print(f"MoE validation: {r0:.4f} -> {r5:.4f} (step 5)")
    # Greedy validation is deterministic: step 5's weights, loaded at EP 1, score the same.
    assert resumed[5]["val/score/mean"] == r5
    assert r5 - r0 >= 0.15


def test_every_moe_sync_leaves_vllm_agreeing_with_the_actor(runs):
    diffs = [m["rollout/logprob_diff_max"] for s, m in runs["main"].items() if s > 0]
    diffs.append(runs["resumed"][6]["rollout/logprob_diff_max"])
    assert len(diffs) == 7 and max(diffs) <= 1e-4, max(diffs)


def test_moe_aux_loss_is_reported(runs):
    """``moe_aux_loss_coeff`` is on in the config: the routers' load-balancing loss reaches the
    metrics every step (coefficient-free: E·Σ_e f_e·P_e, 1 when perfectly balanced, at most E;
    its value against a hand computation is the update-equivalence test's)."""
    values = [m["actor/moe_aux_loss"] for s, m in runs["main"].items() if s > 0]
    assert len(values) == 6 and all(0.5 < v < 8 for v in values), values


def test_routing_replay_runs_in_every_update(runs):
    """``router_replay.mode=R2`` is on in the config: every update replays the old-log-prob
    pass's routing and reports how many real tokens the routers, choosing afresh, would have
    sent elsewhere (the mechanism against independent observation: tests/models/
    test_moe_models.py::test_routing_replay_routes_every_token_as_recorded)."""
    values = [m["actor/router_agreement"] for s, m in runs["main"].items() if s > 0]
    print("router agreement by step: " + ", ".join(f"{v:.4f}" for v in values))
    assert len(values) == 6 and all(0.5 < v <= 1.0 for v in values), values
    assert min(values) < 1.0  # the second mini-batch's routers had moved: replay mattered


def test_moe_checkpoint_resumes_at_another_expert_layout(runs):
    main, resumed = runs["main"][6], runs["resumed"][6]
    assert rollout_prompts(runs["main_dir"], 6) == rollout_prompts(runs["resumed_dir"], 6)
    keys = [k for k in main if k.startswith(("actor/", "critic/", "rollout/score", "reward"))]
    keys = [k for k in keys if not k.startswith("actor/lr")]
    assert {"actor/pg_loss", "actor/grad_norm", "actor/moe_aux_loss"} <= set(keys)
    worst = max(abs(main[k] - resumed[k]) / max(1.0, abs(main[k])) for k in keys)
    print(f"MoE step 6 at EP 1 vs EP 2: largest (relative) difference {worst:.3g}")
    assert worst <= 1e-5, {k: (main[k], resumed[k]) for k in keys}
