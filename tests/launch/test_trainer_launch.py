"""The real trainer through the launch scripts: Slurm (train, preempt, resume) and MLflow.

Skipped, with the reason, while ``megarl/train.py`` has no top-level ``main`` (the trainer issue
builds it). Everything else these tests rely on is tested with stand-ins in test_slurm.py,
test_torchrun_local.py and tests/tracking/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.launch.test_slurm import job_id, node_log, wait_for_job

pytestmark = [
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def tiny_overrides(tmp_path_factory) -> list[str]:
    """Overrides pointing the tiny configs at a tiny model and synthetic data made here."""
    root = tmp_path_factory.mktemp("tiny")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for cmd in (
        ["tools/make_tiny_model.py", "--family", "qwen2", "--out", f"{root}/tiny-qwen2"],
        ["tools/make_synthetic_data.py", "--out", f"{root}/tiny-data"],
    ):
        subprocess.run([sys.executable, *cmd], cwd=REPO, env=env, check=True, capture_output=True)
    return [
        f"actor_rollout_ref.model.path={root}/tiny-qwen2",
        f"data.train_files={root}/tiny-data/train.parquet",
        f"data.val_files={root}/tiny-data/test.parquet",
    ]


def steps_logged(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def submit(slurm, job_env, tmp_path, overrides) -> str:
    cmd = [
        "sbatch", "--nodes=1", "--time=60", f"--output={tmp_path}/batch-%j.out",
        "launch/ppo_72b.slurm", "configs/ppo_tiny_cpu.yaml",
        f"trainer.default_local_dir={tmp_path}/run", *overrides,
    ]  # fmt: skip
    done = slurm.run(*cmd, env=job_env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return job_id(done.stdout)


def test_sbatch_ppo_72b_script_trains_the_tiny_ppo_config(slurm, job_env, tmp_path, tiny_overrides):
    cmd = [
        "sbatch", "--wait", "--nodes=1", "--time=60", f"--output={tmp_path}/batch-%j.out",
        "launch/ppo_72b.slurm", "configs/ppo_tiny_cpu.yaml",
        f"trainer.default_local_dir={tmp_path}/run", "trainer.total_training_steps=2",
        *tiny_overrides,
    ]  # fmt: skip
    done = slurm.run(*cmd, env=job_env, cwd=REPO, timeout=900)
    job = job_id(done.stdout.splitlines()[0])
    assert done.returncode == 0, (tmp_path / f"batch-{job}.out").read_text()[-5000:]
    assert steps_logged(tmp_path / "run") == [1, 2]
    log = node_log(tmp_path, job, slurm.node).read_text()
    assert "step 1 " in log and "step 2 " in log


def test_preempted_job_saves_and_a_second_job_resumes(slurm, job_env, tmp_path, tiny_overrides):
    run_dir = tmp_path / "run"
    first = submit(slurm, job_env, tmp_path, ["trainer.total_training_steps=50", *tiny_overrides])
    # a timeout on polling the run directory (no handle to wait on), not a timing claim
    deadline = time.monotonic() + 600
    while not ((run_dir / "metrics.jsonl").exists() and steps_logged(run_dir)):
        assert time.monotonic() < deadline, "the first job logged no step within 600 s"
        time.sleep(1)
    assert slurm.run("scancel", "--signal=USR1", "--batch", first).returncode == 0
    assert wait_for_job(slurm, first, 600) == 0, (tmp_path / f"batch-{first}.out").read_text()
    saved = int((run_dir / "latest_checkpointed_iteration.txt").read_text())
    assert steps_logged(run_dir)[-1] == saved < 50

    second = submit(slurm, job_env, tmp_path, [f"trainer.total_training_steps={saved + 1}",
                                                *tiny_overrides])  # fmt: skip
    assert wait_for_job(slurm, second, 600) == 0, (tmp_path / f"batch-{second}.out").read_text()
    assert steps_logged(run_dir)[-1] == saved + 1
    log = node_log(tmp_path, second, slurm.node).read_text()
    assert f"step {saved + 1} " in log and f"step {saved} " not in log


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
