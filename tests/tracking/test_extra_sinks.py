"""The wandb (offline) and TensorBoard sinks log what the MLflow sink logs; missing extras are
refused at validation.

The real packages write real files, read back with their own formats (``readers.py``); MLflow
is the run directory's local SQLite store. No network: wandb must go offline by itself.
"""

from __future__ import annotations

import json
import sys

import pytest

from megarl.config import ConfigError, load_config, to_dict, to_yaml, validate
from megarl.tracking import SenderOptions, make_sinks, sanitize_name
from megarl.tracking.paths import SUPERSEDED_METRICS_FILE, TENSORBOARD_DIR, WANDB_DIR
from tests.tracking.readers import tensorboard_scalars, wandb_config, wandb_history

KEYS = ["actor/pg_loss", "critic/score/mean", "timing_s/step", "a@b", "a_b"]
STEPS = (1, 2, 3)


def metrics(step: int) -> dict[str, float]:
    return {k: step + i / 8 for i, k in enumerate(KEYS)}


@pytest.fixture
def no_wandb_key(monkeypatch, tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "TENSORBOARD_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


def run_all_sinks(run_dir, *, resumed: bool = False, steps=STEPS, config=None):
    tracker = make_sinks(
        ["console", "mlflow", "wandb", "tensorboard"],
        run_dir,
        rank=0,
        world_size=1,
        project_name="proj",
        experiment_name="exp",
        resumed=resumed,
        options=SenderOptions(finish_timeout_s=60, poll_s=0.2),
    )
    with tracker:
        if config is not None:
            tracker.log_config(to_dict(config), to_yaml(config))
        for step in steps:
            tracker.log_metrics(step, metrics(step))
    return tracker


def mlflow_logged(run_dir, run_id: str) -> dict[tuple[str, int], float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    return {
        (key, m.step): m.value
        for key in KEYS
        for m in client.get_metric_history(run_id, sanitize_name(key))
    }


def test_wandb_offline_and_tensorboard_log_what_mlflow_logs(tmp_path, no_wandb_key):
    run_dir = tmp_path / "run"
    cfg = load_config(["configs/grpo_tiny_cpu.yaml"], [f"trainer.default_local_dir={run_dir}"])
    tracker = run_all_sinks(run_dir, config=cfg)

    expected = {(k, s): v for s in STEPS for k, v in metrics(s).items()}
    assert mlflow_logged(run_dir, tracker.run_id) == pytest.approx(expected)
    assert tensorboard_scalars(run_dir / TENSORBOARD_DIR) == pytest.approx(expected)
    (run_file,) = (run_dir / WANDB_DIR).glob("offline-run-*/run-*.wandb")
    assert wandb_history(run_file) == pytest.approx(expected)
    assert wandb_config(run_file)["trainer"]["project_name"] == cfg.trainer.project_name


def test_a_resumed_launch_continues_the_wandb_run(tmp_path, no_wandb_key):
    run_dir = tmp_path / "run"
    run_all_sinks(run_dir, steps=(1, 2))
    run_all_sinks(run_dir, resumed=True, steps=(3,))
    files = sorted((run_dir / WANDB_DIR).glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and files[0].name == files[1].name  # one run id, two launches
    assert {s for _, s in wandb_history(files[1])} == {3}
    assert {s for _, s in tensorboard_scalars(run_dir / TENSORBOARD_DIR)} == {1, 2, 3}


def test_a_launch_resumed_from_an_older_checkpoint_supersedes_the_steps_it_runs_again(tmp_path):
    """Issue 40: steps 1-3 logged, the launch resumed from step 1's checkpoint validates at step
    1 and runs steps 2-3 again. metrics.jsonl holds each step once (step 1 with its validation
    merged in, steps 2-3 the new values; the old ones in metrics.superseded.jsonl, which the
    console says); TensorBoard shows the new values only (purge_step). MLflow and wandb keep
    what each launch sent (docs/operations.md)."""
    from megarl.tracking import read_metrics

    def launch(steps, of, **resume) -> list[str]:
        notes: list[str] = []
        tracker = make_sinks(["tensorboard"], run_dir, rank=0, world_size=1, project_name="p",
                             experiment_name="e", notify=notes.append, **resume)  # fmt: skip
        with tracker:
            for step in steps:
                tracker.log_metrics(step, of(step))
        return notes

    def again(step: int) -> dict[str, float]:
        return {"val/score/mean": 0.5} if step == 1 else {k: -v for k, v in metrics(step).items()}

    run_dir = tmp_path / "run"
    launch(STEPS, metrics)
    notes = launch((1, 2, 3), again, resumed=True, resume_step=1)
    assert notes[0] == (
        "step(s) 2-3 ran after the checkpoint of step 1 this launch resumes from and run again: "
        "their metrics moved from metrics.jsonl to metrics.superseded.jsonl"
    )
    new = {1: {**metrics(1), "val/score/mean": 0.5}, 2: again(2), 3: again(3)}
    assert [(step, m) for step, _, m in read_metrics(run_dir)] == list(new.items())
    superseded = [json.loads(line) for line in (run_dir / SUPERSEDED_METRICS_FILE).open()]
    assert [(r["step"], r["metrics"]) for r in superseded] == [(2, metrics(2)), (3, metrics(3))]
    expected = {(k, s): v for s, m in new.items() for k, v in m.items()}
    assert tensorboard_scalars(run_dir / TENSORBOARD_DIR) == pytest.approx(expected)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    events.Reload()  # every event of both launches' files, the purged ones left out
    assert [(e.step, e.value) for e in events.Scalars(KEYS[0])] == [(1, 1.0), (2, -2.0), (3, -3.0)]


@pytest.mark.parametrize("logger", ["wandb", "tensorboard"])
def test_a_missing_extra_is_refused_at_validation_naming_it(monkeypatch, logger):
    monkeypatch.setitem(sys.modules, logger, None)  # what `import` sees when it is not installed
    cfg = load_config(["configs/grpo_tiny_cpu.yaml"], [f"trainer.logger=[console,{logger}]"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=2)
    (line,) = [x for x in str(err.value).splitlines() if logger in x]
    assert f"pip install 'megarl[{logger}]'" in line


@pytest.mark.parametrize("logger", ["wandb", "tensorboard"])
def test_an_installed_extra_validates(logger):
    cfg = load_config(["configs/grpo_tiny_cpu.yaml"], [f"trainer.logger=[console,{logger}]"])
    validate(cfg, world_size=2)
