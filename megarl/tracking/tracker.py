"""``Tracker``: the trainer's one handle on its metric sinks, and ``make_tracker`` that builds it.

Exactly one rank logs (global rank 0); on every other rank the tracker holds no sink, and its
only job is ``fail``, which writes that rank's failure marker. Nothing here is collective: no
call waits for another rank, so a hung or dead rank cannot hang tracking.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from megarl.tracking import failure
from megarl.tracking.mlflow_ops import RunState
from megarl.tracking.mlflow_sink import MlflowSink, SenderOptions
from megarl.tracking.paths import (
    CONFIG_DIR,
    FAILED_DIR,
    METRICS_FILE,
    MLFLOW_STATE_FILE,
    SUPERSEDED_METRICS_FILE,
    TENSORBOARD_DIR,
    WANDB_DIR,
    WANDB_STATE_FILE,
    TrackingError,
    resolve_tracking_uri,
    run_dir_of,
)
from megarl.tracking.sinks import ConsoleSink, JsonlSink, MetricsSink, Status, warn

LOGGING_RANK = 0
LOGGERS = ("console", "mlflow", "wandb", "tensorboard")


class Tracker:
    """Fans the trainer's calls out to the sinks of the logging rank.

    Call order: ``log_config`` once after start-up, ``log_metrics`` once per step, then exactly
    one of ``finish(status)`` (normal end: "FINISHED"; stop request: "KILLED") or ``fail(exc)``
    (in the exception handler, on any rank). As a context manager it calls ``fail`` on an
    exception and ``finish("FINISHED")`` otherwise; both are idempotent.
    """

    def __init__(
        self,
        sinks: Sequence[MetricsSink],
        *,
        rank: int,
        run_dir: Path,
        mlflow: MlflowSink | None = None,
    ) -> None:
        self.sinks = list(sinks)
        self.rank = rank
        self.run_dir = Path(run_dir)
        self.mlflow = mlflow
        self._ended = False

    @property
    def is_logging_rank(self) -> bool:
        """True on the one rank that logs."""
        return self.rank == LOGGING_RANK

    @property
    def run_id(self) -> str | None:
        """MLflow run id for ``TrainerState`` (logging rank, once the server has answered)."""
        return self.mlflow.run_id if self.mlflow is not None else None

    def log_config(self, resolved: dict, yaml_text: str) -> None:
        """The resolved config as a nested dict and as YAML text, once per launch."""
        for sink in self.sinks:
            sink.log_config(resolved, yaml_text)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Every metric of ``step``, reduced over ranks (only the logging rank's call counts)."""
        stamp = time.time()
        for sink in self.sinks:
            sink.log_metrics(step, metrics, timestamp=stamp)

    def fail(self, exc: BaseException) -> None:
        """Record that this rank failed; call it on any rank before the exception propagates.

        Writes ``<run dir>/failed/rank-<r>``; the logging rank's sender sees it within about a
        second and ends the MLflow run FAILED. On the logging rank itself this waits at most
        ``SenderOptions.fail_timeout_s`` for FAILED to reach the server.
        """
        if self._ended:
            return
        self._ended = True
        line = failure.describe(exc, self.rank)
        try:
            failure.write_marker(self.run_dir, self.rank, line)
        except OSError as err:
            warn(f"cannot write the failure marker of rank {self.rank}: {err}")
        if self.mlflow is not None:
            self.mlflow.fail(line)
        for sink in self.sinks:
            if sink is not self.mlflow:
                sink.finish("FAILED")

    def finish(self, status: Status = "FINISHED") -> None:
        """End the run: "FINISHED", or "KILLED" after a stop request (FAILED wins if any rank
        failed). Waits at most ``SenderOptions.finish_timeout_s`` for MLflow."""
        if self._ended:
            return
        self._ended = True
        for sink in self.sinks:
            sink.finish(status)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.finish("FINISHED")
        elif isinstance(exc, KeyboardInterrupt):
            self.finish("KILLED")
        else:
            self.fail(exc)


def make_sinks(
    loggers: Sequence[str],
    run_dir: Path,
    *,
    rank: int,
    world_size: int,
    project_name: str,
    experiment_name: str,
    tracking_uri: str | None = None,
    nnodes: int = 1,
    resume_run_id: str | None = None,
    resumed: bool | None = None,
    resume_step: int | None = None,
    console_write: Callable[[str], None] = print,
    options: SenderOptions | None = None,
    notify: Callable[[str], None] = warn,
) -> Tracker:
    """Build the tracker of one rank. Call it on every rank right after process-group init.

    ``loggers`` is ``trainer.logger`` (console, mlflow, wandb, tensorboard; the last two in
    ``extra_sinks.py``); ``metrics.jsonl`` is always written.
    ``resume_run_id``: the MLflow run id in the checkpoint this launch resumes from;
    ``resumed`` (default: ``resume_run_id is not None``): this launch continues the run in
    ``run_dir`` (the id then falls back to the one in ``mlflow_run.json``), from the checkpoint
    of step ``resume_step``: steps an earlier launch logged after it are superseded where a sink
    allows (``metrics.jsonl``, TensorBoard; MLflow and wandb keep what they were sent, see
    docs/operations.md). A fresh launch into a run directory that holds an earlier run's files
    moves them to ``previous/<time>/``.
    Raises ``TrackingError`` for an unknown logger or a multi-node run without a tracking URI.
    """
    run_dir = Path(run_dir).resolve()
    unknown = [name for name in loggers if name not in LOGGERS]
    if unknown:
        raise TrackingError(f"trainer.logger has {unknown}; megarl logs to {', '.join(LOGGERS)}")
    uri = resolve_tracking_uri(tracking_uri, run_dir, nnodes) if "mlflow" in loggers else None
    failure.clear_marker(run_dir, rank)
    if rank != LOGGING_RANK:
        return Tracker([], rank=rank, run_dir=run_dir)
    resumed = resume_run_id is not None if resumed is None else resumed
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (run_dir / FAILED_DIR).glob("rank-*"):
        if not stale.name.removeprefix("rank-").isdigit() or int(stale.name[5:]) >= world_size:
            stale.unlink(missing_ok=True)
    if not resumed:
        _archive_previous_run(run_dir)
        resume_step = None
    sinks: list[Any] = [JsonlSink(run_dir, resume_step=resume_step, notify=notify)]
    if "console" in loggers:
        sinks.append(ConsoleSink(console_write))
    mlflow = None
    if uri is not None:
        state = RunState.load(run_dir) if resumed else None
        if state is None or state.tracking_uri != uri:
            state = RunState(uri, project_name, experiment_name)
        state.run_id = resume_run_id or state.run_id
        state.status, state.status_sent, state.failure = None, False, None
        mlflow = MlflowSink(run_dir, state, world_size=world_size, options=options, notify=notify)
        sinks.append(mlflow)
    if "wandb" in loggers:
        from megarl.tracking.extra_sinks import WandbSink

        sinks.append(
            WandbSink(
                run_dir,
                project_name=project_name,
                experiment_name=experiment_name,
                resumed=resumed,
                notify=notify,
            )
        )
    if "tensorboard" in loggers:
        from megarl.tracking.extra_sinks import TensorboardSink

        purge = None if resume_step is None else resume_step + 1
        sinks.append(TensorboardSink(run_dir, notify=notify, purge_step=purge))
    return Tracker(sinks, rank=rank, run_dir=run_dir, mlflow=mlflow)


def make_tracker(cfg: Any, *, rank: int, world_size: int, **kwargs: Any) -> Tracker:
    """``make_sinks`` with every setting taken from a resolved ``MegarlConfig``."""
    t = cfg.trainer
    if "notify" not in kwargs and "console_write" in kwargs:
        # Tracking notices (a server that does not answer) on the trainer's console, not only
        # in rank 0's log file where its stderr goes.
        write = kwargs["console_write"]
        kwargs["notify"] = lambda message: write(f"megarl tracking: {message}")
    return make_sinks(
        t.logger,
        run_dir_of(cfg),
        rank=rank,
        world_size=world_size,
        project_name=t.project_name,
        experiment_name=t.experiment_name,
        tracking_uri=t.tracking_uri,
        nnodes=t.nnodes,
        **kwargs,
    )


def _archive_previous_run(run_dir: Path) -> None:
    names = (
        METRICS_FILE,
        SUPERSEDED_METRICS_FILE,
        MLFLOW_STATE_FILE,
        CONFIG_DIR,
        WANDB_STATE_FILE,
        WANDB_DIR,
        TENSORBOARD_DIR,
    )
    leftovers = [run_dir / n for n in names]
    leftovers = [p for p in leftovers if p.exists()]
    if not leftovers:
        return
    target = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
    target.mkdir(parents=True, exist_ok=True)
    for path in leftovers:
        shutil.move(str(path), str(target / path.name))
