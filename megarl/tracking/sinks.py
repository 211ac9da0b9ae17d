"""The metrics-sink protocol and the two local sinks: console lines and the JSON-lines file."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Literal, Protocol

from megarl.tracking.paths import METRICS_FILE

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
    infinities as JSON's ``NaN``/``Infinity`` extensions, as Python writes them). This file is
    the source of truth: ``megarl tracking sync`` uploads from it what MLflow did not receive.
    A resumed run appends; steps after its checkpoint then appear twice (the later line wins).
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

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
