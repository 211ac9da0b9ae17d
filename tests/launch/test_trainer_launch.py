"""The real trainer through the launch scripts: Slurm (train; preempt by the script's USR1 trap
in the middle of scoring, resume, equal to the uninterrupted run) and MLflow. What these tests
rely on is also tested with stand-ins in test_slurm.py, test_torchrun_local.py, tests/tracking/.

Scoring uses tests/trainer/test_faults.py's reward file: while ``<root>/hold`` exists each sample
touches ``<root>/hold.scoring`` and takes 0.3 s, so the preemption lands inside step 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._run_outputs import read_metrics, rollout_prompts
from tests.checkpoint.test_trainer_checkpoint import (
    _largest_difference,
    _wait_for,
    _weight_difference,
)
from tests.conftest import REPO
from tests.launch.test_slurm import job_id, wait_for_job
from tests.trainer.test_faults import SCORER

pytestmark = [
    pytest.mark.slow,
]


def steps_logged(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


STEPS = 3


def submit(slurm, job_env, root: Path, run_dir: Path, tiny: list[str]) -> str:
    """``sbatch`` the 72B script on the tiny PPO config for STEPS steps; the job id."""
    (root / "scorer.py").write_text(SCORER)
    cmd = [
        "sbatch", "--nodes=1", "--time=60", f"--output={root}/batch-%j.out",
        "launch/ppo_72b.slurm", "configs/ppo_tiny_cpu.yaml", *tiny,
        f"trainer.default_local_dir={run_dir}", f"trainer.rollout_data_dir={run_dir}/rollouts",
        f"trainer.total_training_steps={STEPS}", f"trainer.save_freq={STEPS}",
        f"custom_reward_function.path={root / 'scorer.py'}",
        f"+custom_reward_function.reward_kwargs.hold={root / 'hold'}",
    ]  # fmt: skip
    done = slurm.run(*cmd, env=job_env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return job_id(done.stdout)


@pytest.fixture(scope="module")
def straight(slurm, tmp_path_factory, tiny_overrides) -> Path:
    """An uninterrupted job's run directory (``job_env`` is function-scoped: its value here)."""
    from tests.launch.conftest import job_environment

    root = tmp_path_factory.mktemp("straight")
    job = submit(slurm, job_environment(slurm), root, root / "run", tiny_overrides)
    assert wait_for_job(slurm, job, 900) == 0, (root / f"batch-{job}.out").read_text()[-5000:]
    return root / "run"


def test_sbatch_ppo_72b_script_trains_the_tiny_ppo_config(straight):
    assert steps_logged(straight) == list(range(1, STEPS + 1))
    out = next(straight.parent.glob("batch-*.out")).read_text()
    assert "step 1 " in out and f"step {STEPS} " in out and "Traceback" not in out, out[-5000:]


def test_a_preempted_job_saves_the_step_in_flight_and_the_next_job_equals_the_straight_run(
    slurm, job_env, tmp_path, tiny_overrides, straight
):
    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    hold.touch()
    first = submit(slurm, job_env, tmp_path, run_dir, tiny_overrides)
    out = tmp_path / f"batch-{first}.out"
    _wait_for((tmp_path / "hold.scoring").exists, "step 1's scoring")
    assert slurm.run("scancel", "--signal=USR1", "--batch", first).returncode == 0
    _wait_for(lambda: "USR1 received" in out.read_text(), "the script's USR1 trap")
    hold.unlink()
    assert wait_for_job(slurm, first, 600) == 0, out.read_text()[-5000:]
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert steps_logged(run_dir) == [1] and "Traceback" not in out.read_text()

    second = submit(slurm, job_env, tmp_path, run_dir, tiny_overrides)
    out = tmp_path / f"batch-{second}.out"
    assert wait_for_job(slurm, second, 600) == 0, out.read_text()[-5000:]
    assert f"resumed from {run_dir / 'global_step_1'}" in out.read_text(), out.read_text()[-5000:]
    ref, got = read_metrics(straight), read_metrics(run_dir)
    ppo = ("actor/pg_loss", "critic/vf_loss", "critic/score/mean")
    assert max(_largest_difference(ref[s], got[s], ppo) for s in range(1, STEPS + 1)) == 0.0
    assert _weight_difference(straight, run_dir, step=STEPS) == 0.0
    assert all(
        rollout_prompts(straight, s) == rollout_prompts(run_dir, s) for s in range(1, STEPS + 1)
    )


def test_two_process_training_is_one_mlflow_run(tmp_path, tiny_overrides, monkeypatch):
    """... and the wandb (offline: no key, no network) and TensorBoard sinks log the same."""
    from mlflow.tracking import MlflowClient

    from tests.tracking.readers import tensorboard_scalars, wandb_history

    for name in ("WANDB_API_KEY", "WANDB_MODE", "TENSORBOARD_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))

    from tests.tracking.mlflow_server import MlflowServer

    (tmp_path / "server").mkdir()
    server = MlflowServer(tmp_path / "server")
    server.start()
    try:
        done = subprocess.run(
            ["launch/torchrun_local.sh", "configs/grpo_tiny_cpu.yaml",
             f"trainer.default_local_dir={tmp_path}/run", "trainer.total_training_steps=2",
             "trainer.logger=[console,mlflow,wandb,tensorboard]",
             # the trainer's own sampler (no vLLM start) and 16 validation prompts: what is
             # under test is the tracking, not the rollout
             "actor_rollout_ref.rollout.name=actor", "data.val_max_samples=16",
             f"trainer.tracking_uri={server.uri}",
             "trainer.project_name=trainer-test", *tiny_overrides],
            cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
            env={**os.environ, "MEGARL_PYTHON": sys.executable, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-5000:]
        client = MlflowClient(server.uri)
        experiment = client.get_experiment_by_name("trainer-test")
        (run,) = client.search_runs([experiment.experiment_id])
        assert run.info.status == "FINISHED" and run.info.run_name == "grpo_tiny_cpu"
        assert run.data.params["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"] == "2"
        records = [json.loads(line) for line in
                   (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
        logged: dict[str, list[int]] = {}
        for record in records:
            for key in record["metrics"]:
                logged.setdefault(key, []).append(record["step"])
        assert "actor/pg_loss" in logged and logged["actor/pg_loss"] == [1, 2]
        from megarl.tracking import sanitize_name

        in_mlflow = set()
        for key, steps in logged.items():  # every metric at every step the trainer logged it
            history = client.get_metric_history(run.info.run_id, sanitize_name(key))
            assert sorted(m.step for m in history) == sorted(steps), key
            in_mlflow |= {(key, m.step) for m in history}
        assert set(tensorboard_scalars(tmp_path / "run" / "tensorboard")) == in_mlflow
        (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
        assert set(wandb_history(run_file)) == in_mlflow
        # wandb's own lines go to rank 0's log file; the terminal has megarl's notice only
        assert "wandb:" in (tmp_path / "run" / "logs" / "rank0.log").read_text()
        assert "wandb:" not in done.stdout + done.stderr
        assert "megarl tracking: wandb run" in done.stdout
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "config")}
        assert "config/config.yaml" in artifacts
    finally:
        server.stop()
