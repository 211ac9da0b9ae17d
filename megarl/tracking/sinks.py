"""The metrics-sink protocol and the two local sinks: console lines and the JSON-lines file."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Literal, Protocol

from megarl.tracking.paths import METRICS_FILE, SUPERSEDED_METRICS_FILE

Status = Literal["FINISHED", "FAILED", "KILLED"]


class MetricsSink(Protocol):
    """Where the trainer's metrics go. Called on the logging rank only (``Tracker`` sees to it)."""

    def log_config(self, resolved: dict, yaml_text: str) -> None:
        """The resolved config (nested dict) and its YAML text, once per launch."""

    def log_metrics(
        self, step: int, metrics: Mapping[str, float], *, timestamp: float | None = None
    ) -> None:
        """Every metric of ``step`` (already reduced over ranks); ``timestamp``: unix seconds."""

    def finish(self, status: Status) -> None:
        """The run ended (idempotent)."""


# The console line: (metric, label, format), in this order, those present.
CONSOLE_KEYS: tuple[tuple[str, str, str], ...] = (
    ("critic/score/mean", "score", "{:.3f}"),
    ("actor/pg_loss", "pg_loss", "{:.4g}"),
    ("actor/entropy", "entropy", "{:.3f}"),
    ("actor/grad_norm", "grad_norm", "{:.3g}"),
    ("response_length/mean", "resp_len", "{:.1f}"),
    ("timing_s/step", "step_s", "{:.1f}"),
    ("val/score/mean", "val", "{:.3f}"),
)


def console_line(step: int, metrics: Mapping[str, float]) -> str:
    """``step 3 | score 0.500 | pg_loss -0.0123 | ...`` from the chosen keys that are present."""
    parts = [f"step {step}"]
    for key, label, fmt in CONSOLE_KEYS:
        if key in metrics:
            value = float(metrics[key])
            parts.append(f"{label} {fmt.format(value) if math.isfinite(value) else value}")
    return " | ".join(parts)


class ConsoleSink:
    """One readable line per step; ``write`` may be ``tqdm.write`` to keep a progress bar intact."""

    def __init__(self, write: Callable[[str], None] = print) -> None:
        self._write = write

    def log_config(self, resolved: dict, yaml_text: str) -> None:
        """Nothing: the trainer prints its own start-up summary."""

    def log_metrics(
        self, step: int, metrics: Mapping[str, float], *, timestamp: float | None = None
    ) -> None:
        self._write(console_line(step, metrics))

    def finish(self, status: Status) -> None:
        """Nothing: the trainer prints where its outputs are."""


class JsonlSink:
    """``<run dir>/metrics.jsonl``: every metric of every step, appended and flushed per step.

    Each line is ``{"step": N, "time": unix seconds, "metrics": {name: value}}`` (NaN and
    infinities as JSON's ``NaN``/``Infinity`` extensions, as Python writes them), one line per
    step. This file is the source of truth: ``megarl tracking sync`` uploads from it what MLflow
    did not receive.

    A launch resuming from the checkpoint of step ``resume_step`` appends to it, after moving
    the lines of later steps (run by an earlier launch after that checkpoint, and about to run
    again) to ``metrics.superseded.jsonl``, which ``notify`` says; a step logged again at once
    (validation before training, at the checkpoint's step) is merged into its line.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        resume_step: int | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last: dict | None = None  # the file's last record, where it starts
        self._last_offset = 0
        if resume_step is not None and self.path.exists():
            self._supersede_after(resume_step, notify or warn)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def _supersede_after(self, resume_step: int, notify: Callable[[str], None]) -> None:
        """Keep one line per step up to ``resume_step`` (a step's lines merged, later values
        winning; a torn line dropped) and move the lines of later steps aside."""
        kept: dict[int, dict] = {}
        later: list[str] = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    step = int(record["step"])
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue
                if step > resume_step:
                    later.append(line if line.endswith("\n") else line + "\n")
                elif step in kept:
                    kept[step]["time"] = record.get("time", kept[step].get("time"))
                    kept[step]["metrics"].update(record.get("metrics", {}))
                else:
                    kept[step] = record
        if later:
            with open(self.path.with_name(SUPERSEDED_METRICS_FILE), "a", encoding="utf-8") as f:
                f.writelines(later)
            steps = sorted({json.loads(line)["step"] for line in later})
            shown = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
            notify(
                f"step(s) {shown} ran after the checkpoint of step {resume_step} this launch "
                f"resumes from and run again: their metrics moved from {METRICS_FILE} to "
                f"{SUPERSEDED_METRICS_FILE}"
            )
        tmp = self.path.with_name(f".{METRICS_FILE}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for record in kept.values():
                self._last_offset, self._last = f.tell(), record
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, self.path)

    def log_config(self, resolved: dict, yaml_text: str) -> None:
        """Nothing: the config snapshot lives in ``config/`` (the tracker writes it)."""

    def log_metrics(
        self, step: int, metrics: Mapping[str, float], *, timestamp: float | None = None
    ) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path}: metrics logged after finish()")
        timestamp = time.time() if timestamp is None else timestamp
        record = {
            "step": int(step),
            "time": timestamp,
            "metrics": {k: float(v) for k, v in metrics.items()},
        }
        if self._last is not None and self._last["step"] == record["step"]:
            record["metrics"] = {**self._last["metrics"], **record["metrics"]}
            self._file.truncate(self._last_offset)  # rewritten merged, as the last line
        else:
            self._last_offset = self._file.tell()
        self._last = record
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def finish(self, status: Status) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(run_dir: Path) -> list[tuple[int, float, dict[str, float]]]:
    """``metrics.jsonl`` as ``(step, time, metrics)`` records in file order.

    A torn last line (the process died while writing it) is skipped.
    """
    path = Path(run_dir) / METRICS_FILE
    records = []
    if not path.exists():
        return records
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            records.append((int(record["step"]), float(record["time"]), record["metrics"]))
    return records


def warn(message: str) -> None:
    """megarl's one-line notices about tracking, on stderr."""
    print(f"megarl tracking: {message}", file=sys.stderr, flush=True)
