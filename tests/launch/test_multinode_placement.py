"""vLLM on a node of its own (issue 26) and a distillation teacher's pool on a node of its own
(issue 57), launched as ``launch/_slurm_job.sh`` launches each node of a job: three ``megarl
train --nodes 3 --rdzv-endpoint ...`` processes on this machine are the job's three "nodes" of 2
ranks each. The first to join the rendezvous trains (actor TP 2), the next holds vLLM (TP 1 x 2
replicas), the last the teacher's vLLM (the student's own checkpoint, TP 1 x 2 replicas, its k3
loss weighted 0 so that the task alone trains); 3 steps one step off learn, as on one node, and
the teacher on its node scores the first step's samples as the rollout did."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megarl.parallel.spawn import free_port
from tests._run_outputs import read_metrics
from tests.conftest import REPO, left_behind

STEPS = 3
NODES = 3
MODEL = "actor_rollout_ref.model.path="
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multirank]


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_overrides) -> dict:
    out = tmp_path_factory.mktemp("placement")
    (out / "tmp").mkdir()
    run_dir, port = out / "run", free_port()
    model = next(o.split("=", 1)[1] for o in tiny_overrides if o.startswith(MODEL))
    args = [sys.executable, "-m", "megarl.cli", "train", "--nodes", str(NODES),
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "placement",
            "--log-dir", str(out / "logs"), "-c", "configs/grpo_tiny_cpu.yaml", *tiny_overrides,
            "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "async_training.staleness_threshold=1", f"trainer.total_training_steps={STEPS}",
            f"trainer.test_freq={STEPS}", f"trainer.default_local_dir={run_dir}",
            "distillation.enabled=true", "distillation.nnodes=1", "distillation.n_gpus_per_node=2",
            f"+distillation.teacher_models.teacher_model.model_path={model}",
            "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1",
            "distillation.distillation_loss.distillation_loss_coef=0.0"]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(out / "tmp")}
    nodes = [subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(NODES)]  # fmt: skip
    done = [node.communicate(timeout=900) for node in nodes]
    return {"codes": [n.returncode for n in nodes], "done": done, "run_dir": run_dir, "out": out}


def test_both_nodes_finish_and_the_run_learns(job):
    assert job["codes"] == [0] * NODES, [err[-3000:] for _, err in job["done"]]
    m = read_metrics(job["run_dir"])
    assert [m[s]["async/staleness_max"] for s in range(1, STEPS + 1)] == [0.0, 1.0, 1.0]
    assert m[STEPS]["val/score/mean"] - m[0]["val/score/mean"] >= 0.15
    # the teacher (the initial weights, vLLM as the rollout) on its node: step 1's samples
    assert m[1]["distillation/teacher_model/sequences"] == 8 * 8
    assert abs(m[1]["distillation/teacher_model/k1_vs_rollout"]) <= 1e-4, m[1]
    assert all(m[s]["timing_s/teacher"] > 0 for s in range(1, STEPS + 1))


def test_the_console_says_vllm_has_a_node_of_its_own(job):
    said = "".join(out for out, _ in job["done"])
    assert "2 rank(s), TP 2" in said, said[-2000:]
    assert "rollout vllm TP 1 x 2 replicas on 2 rank(s) of its own, one step off" in said
    assert "teacher vllm TP 1 x 2 replica(s) on 2 rank(s) of its own" in said, said[-2000:]
    logs = sorted(p.name for p in (job["run_dir"] / "logs").glob("rank*.log"))
    assert logs == [f"rank{r}.log" for r in range(2 * NODES)]


def test_nothing_is_left_in_the_temporary_directory(job):
    assert left_behind(job["out"] / "tmp") == []
