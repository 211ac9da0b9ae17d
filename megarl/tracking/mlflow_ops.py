"""MLflow operations shared by the live sender thread and ``megarl tracking sync``.

``mlflow`` is imported inside these functions only: the trainer's entry module stays light to
import, and the live sink imports it on its sender thread, never on the training step's path.
Every operation is idempotent, so a retry after a lost answer, or a sync after a live run that
uploaded part of its data, never duplicates anything: a metric value is keyed by (key, step,
timestamp, value) and the timestamp is the one stored in ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megarl.tracking import names
from megarl.tracking.paths import CONFIG_DIR, LOCAL_ARTIFACTS_DIR, MLFLOW_STATE_FILE

RESUME_TAG = "megarl.resume.{k}.changed_keys"
FAILURE_TAG = "megarl.failure"
TERMINAL = ("FINISHED", "FAILED", "KILLED")


def configure_http(timeout_s: int, retries: int = 0) -> None:
    """Make MLflow's HTTP client give up after ``timeout_s`` with ``retries`` retries.

    By default it retries a dead server 7 times with exponential backoff and waits 120 s per
    request (minutes per call); megarl retries on its own schedule instead. These variables are
    read per request, process-wide: megarl owns the training process.
    """
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, int(timeout_s)))
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(retries)
    os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] = "1"
    os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_JITTER"] = "0"
    # set_terminated prints "View run ... at ..." on stdout: megarl prints its own line.
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


def is_permanent(exc: BaseException) -> bool:
    """True for errors a retry cannot fix (a 4xx answer other than 429)."""
    status = getattr(exc, "get_http_status_code", None)
    if status is None:
        return False
    code = status()
    return 400 <= code < 500 and code != 429


@dataclass
class RunState:
    """``mlflow_run.json``: what sync needs to finish a run the live sender could not."""

    tracking_uri: str
    experiment_name: str
    run_name: str
    run_id: str | None = None
    configs: list[str] = field(default_factory=list)
    """Config snapshots in ``config/`` (stems, launch order: config, resume-1, ...)."""
    uploaded_configs: list[str] = field(default_factory=list)
    status: str | None = None
    """The status the run ended with in the trainer (None while it runs)."""
    status_sent: bool = False
    failure: str | None = None

    @classmethod
    def load(cls, run_dir: Path) -> RunState | None:
        """The state saved in ``run_dir``, or None when the run never used MLflow."""
        path = Path(run_dir) / MLFLOW_STATE_FILE
        if not path.exists():
            return None
        return cls(**json.loads(path.read_text()))

    def save(self, run_dir: Path) -> None:
        """Write the state atomically (a reader never sees half a file)."""
        path = Path(run_dir) / MLFLOW_STATE_FILE
        tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, path)


def make_client(uri: str) -> Any:
    """An ``MlflowClient`` for ``uri`` (imports mlflow)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def ensure_run(client: Any, state: RunState, run_dir: Path, tags: dict[str, str]) -> str:
    """Reopen ``state.run_id`` or create the experiment and run.

    Returns "reopened", "created", or "replaced" (the run to resume is not on this server, e.g.
    the tracking URI changed: a new run is created rather than losing the metrics).
    """
    from mlflow.exceptions import MlflowException

    outcome = "created"
    if state.run_id is not None:
        try:
            run = client.get_run(state.run_id)
        except MlflowException as exc:
            if not is_permanent(exc):
                raise
            state.run_id, state.uploaded_configs, outcome = None, [], "replaced"
        else:
            if run.info.status != "RUNNING" and state.status is None:
                client.update_run(state.run_id, status="RUNNING")
            return "reopened"
    experiment = client.get_experiment_by_name(state.experiment_name)
    if experiment is None:
        local = None
        if state.tracking_uri.startswith("sqlite:") and Path(run_dir).exists():
            local = (Path(run_dir) / LOCAL_ARTIFACTS_DIR).resolve().as_uri()
        try:
            experiment_id = client.create_experiment(state.experiment_name, local)
        except MlflowException:  # created by another run meanwhile
            experiment_id = client.get_experiment_by_name(state.experiment_name).experiment_id
    else:
        experiment_id = experiment.experiment_id
    run = client.create_run(experiment_id, run_name=state.run_name, tags=tags)
    state.run_id = run.info.run_id
    return outcome


def push_config(client: Any, state: RunState, run_dir: Path, stem: str) -> None:
    """Upload one config snapshot: params once (first config of the run), else a changed-keys tag.

    MLflow refuses to change a logged param, so a resumed launch logs no params; it tags the
    keys whose values differ from the logged ones and uploads its own YAML next to the first.
    """
    directory = Path(run_dir) / CONFIG_DIR
    params = names.config_params(json.loads((directory / f"{stem}.json").read_text()))
    logged = client.get_run(state.run_id).data.params
    if not logged:
        from mlflow.entities import Param

        batch = [Param(k, v) for k, v in params.items()]
        for part in names.chunks(batch, names.MAX_PARAMS_PER_BATCH):
            client.log_batch(state.run_id, params=list(part), synchronous=True)
    elif stem != "config":
        changed = names.changed_keys(logged, params)
        value = names.truncate(",".join(changed) or "(none)", names.MAX_TAG_VALUE_LENGTH)
        client.set_tag(state.run_id, RESUME_TAG.format(k=stem.removeprefix("resume-")), value)
    client.log_artifact(state.run_id, str(directory / f"{stem}.yaml"), artifact_path=CONFIG_DIR)


def push_metrics(client: Any, run_id: str, records: list[tuple[int, float, dict]]) -> None:
    """Log ``(step, unix time, {name: value})`` records, at most 1000 values per request."""
    from mlflow.entities import Metric

    batch = [
        Metric(names.sanitize_name(k), float(v), round(t * 1000), step)
        for step, t, metrics in records
        for k, v in metrics.items()
    ]
    for part in names.chunks(batch, names.MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=list(part), synchronous=True)


def terminate(client: Any, state: RunState) -> None:
    """End the run with ``state.status`` (and the failure line as a tag)."""
    if state.failure:
        value = names.truncate(state.failure, names.MAX_TAG_VALUE_LENGTH)
        client.set_tag(state.run_id, FAILURE_TAG, value)
    client.set_terminated(state.run_id, status=state.status)
