"""What a finished ``megarl train`` run left in its directory, read back by the end-to-end tests."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """``metrics.jsonl`` as {step: {metric: value}} (records of one step merged)."""
    steps: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record["metrics"])
    return steps


def rollout_prompts(run_dir: Path, step: int) -> list[str]:
    """The prompts of ``step``'s rollout dump (``trainer.rollout_data_dir=RUN/rollouts``)."""
    lines = (run_dir / "rollouts" / f"{step}.jsonl").read_text().splitlines()
    return [json.loads(line)["input"] for line in lines]
