"""Files of a run directory that tracking, the launch scripts and the trainer agree on.

::

    <run dir>/
        metrics.jsonl      every metric of every step, one JSON object per line (source of truth)
        metrics.superseded.jsonl   lines of steps a resumed launch ran again (the abandoned run's)
        config/            config.yaml of the first launch, resume-<k>.yaml of later launches
        mlflow_run.json    MLflow state: URI, run id, what has reached the server, final status
        mlflow.db          the default local MLflow store, mlartifacts/ its artifacts
        wandb/, wandb_run.json, tensorboard/   the wandb and TensorBoard sinks' files
        failed/rank-<r>    written by a rank that failed; the logging rank records FAILED
        STOP               written by the Slurm USR1 trap: the trainer stops after this step

The run directory is ``trainer.default_local_dir`` (verl's checkpoint directory); it must be on
a filesystem every node sees (the stop file and failure markers cross nodes through it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
SUPERSEDED_METRICS_FILE = "metrics.superseded.jsonl"
CONFIG_DIR = "config"
MLFLOW_STATE_FILE = "mlflow_run.json"
LOCAL_STORE_FILE = "mlflow.db"
LOCAL_ARTIFACTS_DIR = "mlartifacts"
FAILED_DIR = "failed"
WANDB_DIR = "wandb"
WANDB_STATE_FILE = "wandb_run.json"
TENSORBOARD_DIR = "tensorboard"
STOP_FILE = "STOP"


class TrackingError(RuntimeError):
    """A tracking setting or run directory that cannot work (one line naming it)."""


def run_dir_of(cfg: Any) -> Path:
    """The run directory of a resolved ``MegarlConfig``, absolute."""
    return Path(cfg.trainer.default_local_dir).expanduser().resolve()


def resolve_tracking_uri(configured: str | None, run_dir: Path, nnodes: int) -> str:
    """``trainer.tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else a SQLite store in run_dir.

    The local default is refused for multi-node runs: SQLite on a network filesystem corrupts
    under concurrent access and is slow, so such runs must name a server.
    """
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    if nnodes > 1:
        raise TrackingError(
            "trainer.logger has mlflow on a multi-node run but no tracking server: set "
            "trainer.tracking_uri=http://HOST:PORT (or $MLFLOW_TRACKING_URI)"
        )
    return f"sqlite:///{Path(run_dir).resolve() / LOCAL_STORE_FILE}"
