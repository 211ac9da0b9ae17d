"""The MLflow sink against a real server: one run, params, every step metric, artifact, status."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import load_config, to_dict, to_yaml
from megarl.tracking import SenderOptions, TrackingError, make_sinks, make_tracker
from megarl.tracking.mlflow_ops import RunState
from tests.tracking.conftest import step_keys

pytestmark = pytest.mark.slow

KEYS = ["actor/pg_loss", "critic/score/mean", "timing_s/step", "a@b", "a_b"]
LONG = "x" * 7000
FAST = SenderOptions(finish_timeout_s=60, poll_s=0.2)


def tiny_config(tmp_path, uri, *overrides):
    return load_config(
        ["configs/grpo_tiny_cpu.yaml"],
        [
            f"trainer.default_local_dir={tmp_path}/run",
            f"trainer.tracking_uri={uri}",
            "trainer.logger=[console,mlflow]",
            f"trainer.project_name=proj-{tmp_path.name}",
            f"+actor_rollout_ref.model.override_config.note={LONG}",
            *overrides,
        ],
    )


def metrics(step: int) -> dict[str, float]:
    return {k: step + i / 10 for i, k in enumerate(KEYS)}


def test_one_run_with_params_metrics_artifact_finished(tmp_path, mlflow_server, client, capsys):
    cfg = tiny_config(tmp_path, mlflow_server.uri)
    with make_tracker(cfg, rank=0, world_size=2, options=FAST) as tracker:
        tracker.log_config(to_dict(cfg), to_yaml(cfg))
        for step in range(1, 4):
            tracker.log_metrics(step, metrics(step))
    assert "step 3 | score 3.100 | pg_loss 3 | step_s 3.2" in capsys.readouterr().out

    experiment = client.get_experiment_by_name(f"proj-{tmp_path.name}")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == tracker.run_id
    assert run.info.run_name == "grpo_tiny_cpu" and run.info.status == "FINISHED"
    params = run.data.params
    assert len(params) > 100  # more than one batch
    assert params["actor_rollout_ref.actor.optim.lr"] == "0.0001"
    assert params["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"] == "2"
    note = params["actor_rollout_ref.model.override_config.note"]
    assert len(note) == 6000 and note.endswith("full value in the config artifact]")
    names = ["actor/pg_loss", "critic/score/mean", "timing_s/step", "a:40:b", "a_b"]
    assert step_keys(client, run.info.run_id, names) == {(s, k) for s in (1, 2, 3) for k in names}
    assert {m.value for m in client.get_metric_history(run.info.run_id, "a:40:b")} == {
        1.3,
        2.3,
        3.3,
    }
    local = client.download_artifacts(run.info.run_id, "config/config.yaml", str(tmp_path))
    assert Path(local).read_text() == to_yaml(cfg)


def test_resume_with_a_changed_override_tags_the_key(tmp_path, mlflow_server, client):
    cfg = tiny_config(tmp_path, mlflow_server.uri)
    tracker = make_tracker(cfg, rank=0, world_size=2, options=FAST)
    tracker.log_config(to_dict(cfg), to_yaml(cfg))
    tracker.log_metrics(1, metrics(1))
    tracker.finish("KILLED")
    run_id = tracker.run_id
    assert client.get_run(run_id).info.status == "KILLED"

    changed = tiny_config(tmp_path, mlflow_server.uri, "actor_rollout_ref.actor.optim.lr=0.5")
    with make_tracker(changed, rank=0, world_size=2, resume_run_id=run_id, options=FAST) as again:
        again.log_config(to_dict(changed), to_yaml(changed))
        again.log_metrics(2, metrics(2))
    assert again.run_id == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["actor_rollout_ref.actor.optim.lr"] == "0.0001"  # not re-logged
    assert run.data.tags["megarl.resume.1.changed_keys"] == "actor_rollout_ref.actor.optim.lr"
    assert {a.path for a in client.list_artifacts(run_id, "config")} == {
        "config/config.yaml",
        "config/resume-1.yaml",
    }
    assert step_keys(client, run_id, ["a_b"]) == {(1, "a_b"), (2, "a_b")}


def test_local_store_by_default_and_multinode_needs_a_uri(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(TrackingError, match="trainer.tracking_uri"):
        make_sinks(["mlflow"], tmp_path, rank=0, world_size=16, nnodes=2,
                   project_name="p", experiment_name="e")  # fmt: skip
    with make_sinks(["mlflow"], tmp_path, rank=0, world_size=1, project_name="p",
                    experiment_name="e", options=FAST) as tracker:  # fmt: skip
        tracker.log_metrics(0, {"x": 1.0})
    state = RunState.load(tmp_path)
    assert state.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    run = MlflowClient(state.tracking_uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics == {"x": 1.0}
    assert run.info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri())


def test_non_logging_rank_logs_nothing(tmp_path, mlflow_server):
    cfg = tiny_config(tmp_path, mlflow_server.uri)
    with make_tracker(cfg, rank=1, world_size=2) as tracker:
        tracker.log_config(to_dict(cfg), to_yaml(cfg))
        tracker.log_metrics(1, metrics(1))
    assert tracker.run_id is None and not (tmp_path / "run").exists()


def test_resuming_a_run_the_server_lacks_starts_a_new_one(tmp_path, mlflow_server, client):
    cfg = tiny_config(tmp_path, mlflow_server.uri)
    notes: list[str] = []
    missing = "0" * 32
    with make_tracker(cfg, rank=0, world_size=2, resume_run_id=missing, notify=notes.append,
                      options=FAST) as tracker:  # fmt: skip
        tracker.log_config(to_dict(cfg), to_yaml(cfg))
        tracker.log_metrics(1, metrics(1))
    assert tracker.run_id != missing
    assert notes[0] == (
        f"MLflow run {missing} (to resume) is not there; new run {tracker.run_id} at "
        f"{mlflow_server.uri}"
    )
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["a_b"] == 1.4
