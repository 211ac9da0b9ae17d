"""Metrics tracking: console lines, ``metrics.jsonl`` in the run directory, MLflow, wandb and
TensorBoard.

Every rank makes a :class:`Tracker` (:func:`make_tracker`) right after process-group init and
calls it in the order :class:`Tracker` documents; only the logging rank's sinks log, and any
rank's ``fail`` gets the run recorded FAILED within seconds (``failure.py``). The run
directory's files are in ``paths.py``; ``megarl tracking sync RUN_DIR`` (``sync.py``) uploads
what the MLflow server missed.
"""

from megarl.tracking.mlflow_sink import SenderOptions
from megarl.tracking.names import sanitize_name
from megarl.tracking.paths import STOP_FILE, TrackingError, run_dir_of
from megarl.tracking.sinks import ConsoleSink, JsonlSink, MetricsSink, read_metrics
from megarl.tracking.sync import sync_run
from megarl.tracking.tracker import Tracker, make_sinks, make_tracker

__all__ = [
    "STOP_FILE",
    "ConsoleSink",
    "JsonlSink",
    "MetricsSink",
    "SenderOptions",
    "Tracker",
    "TrackingError",
    "make_sinks",
    "make_tracker",
    "read_metrics",
    "run_dir_of",
    "sanitize_name",
    "sync_run",
]
