"""The MLflow sink: a background sender thread, so that a training step never waits on MLflow.

The training thread only puts items on a bounded queue (``put_nowait``); a step whose metrics
find it full is re-read from ``metrics.jsonl`` once MLflow answers again. The sender uses megarl's
own timeout and retry schedule (``configure_http``) and backs off for as long as the run lasts;
``finish`` waits a bounded time for the queue to drain, and ``megarl tracking sync`` uploads
what is left. The same thread watches ``<run dir>/failed/`` (``failure.py``) and ends the run
FAILED as soon as any rank records a failure; FAILED is sticky (a later ``finish`` keeps it).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from megarl.tracking import failure, mlflow_ops
from megarl.tracking.mlflow_ops import RunState
from megarl.tracking.paths import CONFIG_DIR
from megarl.tracking.sinks import Status, read_metrics, warn


@dataclass
class SenderOptions:
    """Timeouts and sizes of the sender (megarl's; MLflow's own defaults retry for minutes)."""

    request_timeout_s: int = 10
    """One HTTP request to the tracking server gives up after this."""
    max_backoff_s: float = 10.0
    """Longest pause between attempts while the server does not answer."""
    queue_size: int = 1000
    """Steps waiting to be sent; beyond it they are re-read from metrics.jsonl later."""
    finish_timeout_s: float = 30.0
    """finish() waits at most this long for the queue to drain and the status to be sent."""
    fail_timeout_s: float = 15.0
    """fail() on the logging rank waits at most this long for FAILED to reach the server."""
    poll_s: float = 1.0
    """How often the sender looks for failure markers of other ranks."""


_WAKE = ("wake", None)
"""Put on the queue by finish() and fail(): a sender waiting on the empty queue acts on them at
once instead of at the end of its ``poll_s`` wait (which every run's exit paid, up to 1 s)."""


class MlflowSink:
    """Sends config, metrics and the final status of one run to MLflow from a daemon thread."""

    def __init__(
        self,
        run_dir: Path,
        state: RunState,
        *,
        world_size: int,
        options: SenderOptions | None = None,
        notify: Callable[[str], None] = warn,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.options = options or SenderOptions()
        self._notify = notify
        self._world_size = world_size
        self._state = state
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=self.options.queue_size)
        self._dropped: set[int] = set()
        self._finish = threading.Event()
        self._done = threading.Event()
        self._status_sent = threading.Event()
        self._failed_after_finish = threading.Event()  # a failed attempt once the run ended
        self._down_since: float | None = None
        self._opened = False
        self._save()
        mlflow_ops.configure_http(self.options.request_timeout_s)
        self._thread = threading.Thread(target=self._run, name="megarl-mlflow", daemon=True)
        self._thread.start()

    # ---- called by the training thread --------------------------------------------------------

    @property
    def run_id(self) -> str | None:
        """The MLflow run id once the run exists on the server (None before)."""
        return self._state.run_id

    def log_config(self, resolved: dict, yaml_text: str) -> None:
        directory = self.run_dir / CONFIG_DIR
        directory.mkdir(parents=True, exist_ok=True)
        with self._lock:
            stem = "config" if not self._state.configs else f"resume-{len(self._state.configs)}"
            (directory / f"{stem}.yaml").write_text(yaml_text)
            (directory / f"{stem}.json").write_text(json.dumps(resolved, default=str))
            self._state.configs.append(stem)
            self._save_locked()
        self._put(("config", stem))

    def log_metrics(
        self, step: int, metrics: Mapping[str, float], *, timestamp: float | None = None
    ) -> None:
        stamp = time.time() if timestamp is None else timestamp
        if not self._put(("metrics", (int(step), stamp, dict(metrics)))):
            self._dropped.add(int(step))

    def fail(self, line: str) -> None:
        """Record FAILED now (the logging rank's own failure); waits ``fail_timeout_s`` at most."""
        with self._lock:
            if self._state.status != "FAILED":
                self._state.failure = line
                self._state.status = "FAILED"
                self._state.status_sent = False
                self._status_sent.clear()
                self._save_locked()
        self._finish.set()
        self._put(_WAKE)
        self._wait_while_answering(self._status_sent, self.options.fail_timeout_s)

    def _wait_while_answering(self, event: threading.Event, timeout_s: float) -> bool:
        """Wait for ``event`` up to ``timeout_s``, but not for a server that does not answer:
        False as soon as an attempt made after the run ended has failed (the server was down,
        or went down; either way the console has been told once), True otherwise."""
        deadline = time.monotonic() + timeout_s
        while not event.wait(0.1):
            if self._failed_after_finish.is_set() and self._down_since is not None:
                return False
            if time.monotonic() >= deadline:
                break
        return True

    def finish(self, status: Status) -> None:
        """End the run with ``status`` unless a rank failed (FAILED wins); bounded wait."""
        self._watch_markers()  # a failed rank's marker precedes the SIGTERM torchrun sends us
        with self._lock:
            if self._state.status is None:
                self._state.status = status
                self._save_locked()
        self._finish.set()
        self._put(_WAKE)
        if not self._wait_while_answering(self._done, self.options.finish_timeout_s):
            return  # announced as down, with the sync remedy: everything is in the run directory
        if not self._done.is_set():
            self._notify(
                f"MLflow at {self._state.tracking_uri} did not take everything within "
                f"{self.options.finish_timeout_s:.0f} s; the rest is in {self.run_dir}: "
                f"upload it with `megarl tracking sync {self.run_dir}`"
            )

    def _put(self, item: tuple) -> bool:
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            return False

    # ---- the sender thread ------------------------------------------------------------------

    def _run(self) -> None:
        client = None
        pending: tuple | None = None
        backoff = 1.0
        while True:
            self._watch_markers()
            if pending is None:
                pending = self._next()
            stage = "connect"
            try:
                if client is None:
                    client = mlflow_ops.make_client(self._state.tracking_uri)
                if not self._opened:
                    self._open(client)
                if self._state.status == "FAILED" and not self._state.status_sent:
                    stage = "status"  # before anything queued: FAILED within the bound
                    self._terminate(client)
                if pending is not None:
                    stage = "item"
                    self._send(client, pending)
                    pending = None
                if self._dropped:
                    stage = "backfill"
                    self._backfill(client)
                if self._down_since is not None:
                    self._notify(f"MLflow at {self._state.tracking_uri} answers again")
                    self._down_since = None
                backoff = 1.0
                if pending is None and self._queue.empty() and self._finish.is_set():
                    if not self._state.status_sent:
                        stage = "status"
                        self._terminate(client)
                    self._done.set()
                    return
            except Exception as exc:  # noqa: BLE001 (any failure: keep the data, retry later)
                if not mlflow_ops.is_permanent(exc):
                    self._wait_for_server(exc, backoff)
                    backoff = min(2 * backoff, self.options.max_backoff_s)
                    continue
                self._notify(f"MLflow refused {self._describe(stage, pending)}: {_one_line(exc)}")
                if stage == "connect":  # e.g. the server refuses this experiment name
                    self._status_sent.set()
                    self._done.set()
                    return
                if stage == "item":
                    pending = None
                elif stage == "backfill":
                    self._dropped.clear()
                else:
                    self._mark_status_sent()

    def _wait_for_server(self, exc: BaseException, backoff: float) -> None:
        if self._finish.is_set():
            self._failed_after_finish.set()
        if self._down_since is None:
            self._down_since = time.monotonic()
            self._notify(
                f"MLflow at {self._state.tracking_uri} does not answer ({_one_line(exc)}); "
                f"metrics stay in {self.run_dir} and are sent when it is back, or later with "
                f"`megarl tracking sync {self.run_dir}`"
            )
        self._sleep(backoff)

    def _open(self, client) -> None:
        tags = {"megarl.run_dir": str(self.run_dir), "megarl.world_size": str(self._world_size)}
        wanted = self._state.run_id
        outcome = mlflow_ops.ensure_run(client, self._state, self.run_dir, tags)
        self._opened = True
        self._save()
        where = f"{self._state.run_id} at {self._state.tracking_uri}"
        self._notify(
            {
                "created": f"MLflow run {where}",
                "reopened": f"MLflow run {where} continues",
                "replaced": f"MLflow run {wanted} (to resume) is not there; new run {where}",
            }[outcome]
        )

    def _next(self) -> tuple | None:
        try:
            item = self._queue.get(timeout=self.options.poll_s)
        except queue.Empty:
            return None
        return None if item is _WAKE else item

    def _send(self, client, item: tuple) -> None:
        kind, payload = item
        if kind == "config":
            mlflow_ops.push_config(client, self._state, self.run_dir, payload)
            with self._lock:
                self._state.uploaded_configs.append(payload)
                self._save_locked()
        else:
            mlflow_ops.push_metrics(client, self._state.run_id, [payload])

    def _backfill(self, client) -> None:
        steps = set(self._dropped)
        latest = {r[0]: r for r in read_metrics(self.run_dir) if r[0] in steps}
        mlflow_ops.push_metrics(client, self._state.run_id, list(latest.values()))
        self._dropped -= steps

    def _terminate(self, client) -> None:
        with self._lock:
            state = RunState(**vars(self._state))
        mlflow_ops.terminate(client, state)
        if self._state.status == state.status:  # else a marker turned it FAILED meanwhile
            self._mark_status_sent()

    def _mark_status_sent(self) -> None:
        with self._lock:
            self._state.status_sent = True
            self._save_locked()
        self._status_sent.set()

    def _watch_markers(self) -> None:
        if self._state.status == "FAILED":
            return
        markers = failure.read_markers(self.run_dir)
        if markers:
            with self._lock:
                self._state.failure = "; ".join(markers[r] for r in sorted(markers))
                self._state.status = "FAILED"
                self._state.status_sent = False
                self._status_sent.clear()
                self._save_locked()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, self.options.poll_s))
            self._watch_markers()

    def _describe(self, stage: str, item: tuple | None) -> str:
        if stage == "connect":
            return f"run {self._state.run_id or self._state.run_name}"
        if stage == "status":
            return f"status {self._state.status}"
        if stage == "backfill" or item is None:
            return "metrics re-read from metrics.jsonl"
        kind, payload = item
        return f"config {payload}" if kind == "config" else f"the metrics of step {payload[0]}"

    def _save(self) -> None:
        with self._lock:
            self._save_locked()

    def _save_locked(self) -> None:
        self._state.save(self.run_dir)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"
