"""Metrics tracking: console lines, ``metrics.jsonl`` in the run directory, and MLflow.

The trainer's use, on every rank, right after process-group init::

    tracker = make_tracker(cfg, rank=rank, world_size=world, resume_run_id=state.tracking_run_id)
    try:
        tracker.log_config(to_dict(cfg), to_yaml(cfg))
        for step in ...:
            tracker.log_metrics(step, reduced_metrics)   # only the logging rank's call counts
            state.tracking_run_id = tracker.run_id       # saved with the checkpoint (rank 0)
            if stopping:                                 # STOP file / SIGTERM / SIGUSR1
                tracker.finish("KILLED"); return 0
        tracker.finish("FINISHED")
    except BaseException as exc:
        tracker.fail(exc)                                # any rank: FAILED within seconds
        raise

The run directory layout is in ``megarl/tracking/paths.py``; the failure protocol in
``failure.py``; the MLflow sender in ``mlflow_sink.py``; ``megarl tracking sync RUN_DIR``
(``sync.py``) uploads what the server missed.
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
