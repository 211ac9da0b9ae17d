"""Upload to MLflow what a run directory holds and the server lacks (``megarl tracking sync``).

The run directory is the source of truth: ``metrics.jsonl`` for metrics, ``config/`` for the
config snapshots, ``mlflow_run.json`` for the run id and the status the trainer ended with.
Sync creates the run if the server never saw it, logs params and config artifacts it missed,
uploads every (step, metric) the server does not have, and sets the final status. Running it
twice uploads nothing the second time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megarl.tracking import mlflow_ops, names
from megarl.tracking.mlflow_ops import RunState
from megarl.tracking.paths import METRICS_FILE, MLFLOW_STATE_FILE, TrackingError
from megarl.tracking.sinks import read_metrics


class NotSyncable(TrackingError):
    """The directory given is not a run directory with an MLflow run (an input mistake)."""


@dataclass
class SyncReport:
    """What one sync did."""

    run_id: str
    tracking_uri: str
    values: int
    steps: int
    configs: list[str]
    status: str | None

    def __str__(self) -> str:
        configs = f", config {', '.join(self.configs)}" if self.configs else ""
        status = f", status {self.status}" if self.status else ", run still open"
        return (
            f"run {self.run_id} at {self.tracking_uri}: uploaded {self.values} metric value(s) "
            f"of {self.steps} step(s){configs}{status}"
        )


def sync_run(run_dir: Path, tracking_uri: str | None = None, *, timeout_s: int = 30) -> SyncReport:
    """Bring the MLflow run of ``run_dir`` up to date; ``tracking_uri`` overrides the saved one."""
    run_dir = Path(run_dir)
    state = RunState.load(run_dir)
    if state is None:
        raise NotSyncable(_not_syncable(run_dir))
    if tracking_uri:
        state.tracking_uri = tracking_uri
    mlflow_ops.configure_http(timeout_s, retries=2)
    client = mlflow_ops.make_client(state.tracking_uri)
    try:
        mlflow_ops.ensure_run(client, state, run_dir, {"megarl.run_dir": str(run_dir.resolve())})
    except Exception as exc:
        if mlflow_ops.is_permanent(exc) or type(exc).__name__ != "MlflowException":
            raise
        reason = re.search(r"\[Errno -?\d+\] ([^\"')]+)", str(exc))
        raise TrackingError(
            f"MLflow at {state.tracking_uri} does not answer"
            f"{f' ({reason.group(1)})' if reason else ''}; start it or pass --tracking-uri"
        ) from exc
    state.save(run_dir)
    configs = [c for c in state.configs if c not in state.uploaded_configs]
    for stem in configs:
        mlflow_ops.push_config(client, state, run_dir, stem)
        state.uploaded_configs.append(stem)
        state.save(run_dir)
    missing, steps = _missing_metrics(client, state.run_id, run_dir)
    mlflow_ops.push_metrics(client, state.run_id, missing)
    if state.status is not None and not state.status_sent:
        mlflow_ops.terminate(client, state)
        state.status_sent = True
        state.save(run_dir)
    values = sum(len(m) for _, _, m in missing)
    return SyncReport(state.run_id, state.tracking_uri, values, steps, configs, state.status)


def _not_syncable(run_dir: Path) -> str:
    """Why ``run_dir`` (without ``mlflow_run.json``) has nothing to sync, in one line."""
    if not run_dir.is_dir():
        return f"{run_dir}: no such directory"
    if not (run_dir / METRICS_FILE).exists():
        return (
            f"{run_dir} is not a run directory (no {METRICS_FILE}); `megarl tracking run-dir -c "
            "CONFIG` prints a config's"
        )
    return (
        f"{run_dir / MLFLOW_STATE_FILE} does not exist: {run_dir} is the run directory of a run "
        "without trainer.logger mlflow, nothing to sync"
    )


def _missing_metrics(
    client, run_id: str, run_dir: Path
) -> tuple[list[tuple[int, float, dict]], int]:
    """The (step, key) values of ``metrics.jsonl`` the server lacks (later lines win)."""
    latest: dict[tuple[int, str], tuple[float, float]] = {}
    for step, stamp, metrics in read_metrics(run_dir):
        for key, value in metrics.items():
            latest[(step, key)] = (stamp, value)
    present = {
        (m.step, name)
        for name in {names.sanitize_name(key) for _, key in latest}
        for m in client.get_metric_history(run_id, name)
    }
    by_step: dict[int, tuple[float, dict]] = {}
    for (step, key), (stamp, value) in sorted(latest.items()):
        if (step, names.sanitize_name(key)) not in present:
            by_step.setdefault(step, (stamp, {}))[1][key] = value
    return [(step, stamp, metrics) for step, (stamp, metrics) in by_step.items()], len(by_step)
