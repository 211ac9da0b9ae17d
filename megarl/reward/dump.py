"""Per-step JSON-lines dump of scored samples, for debugging rewards.

``<dir>/<step>.jsonl``, one object per sample with verl's keys (``input``: prompt, ``output``:
response, ``gts``: ground truth, ``score``, ``step``) plus megarl's ``index``, ``data_source``,
``timeout`` and the scorer's dict fields. verl dumps every sample of a step to
``trainer.rollout_data_dir``; megarl dumps the first ``reward_model.dump_samples``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megarl.reward.records import RewardInput, RewardResult

__all__ = ["pick_val_generations", "write_dump", "write_val_generations"]

VAL_GENERATIONS = "val_generations.jsonl"
"""The run directory's file of ``trainer.log_val_generations`` samples, a line per validation."""


def _plain(value: Any) -> Any:
    """JSON-friendly: numbers stay numbers (NaN as null), containers recurse, others str()."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):  # numpy / torch values
        return _plain(value.tolist())
    return str(value)


def write_dump(
    out_dir: Path,
    step: int,
    samples: Sequence[RewardInput],
    responses: Sequence[str],
    result: RewardResult,
) -> Path:
    """Write ``out_dir/<step>.jsonl`` for the first ``len(samples)`` samples of ``result``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{step}.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for i, (sample, response) in enumerate(zip(samples, responses, strict=True)):
            row = {
                "step": step,
                "index": i,
                "data_source": sample.data_source,
                "input": sample.prompt,
                "output": response,
                "gts": _plain(sample.ground_truth),
                "score": result.scores[i].item(),
                "timeout": bool(result.timed_out[i]),
            }
            for name, values in result.fields.items():
                row.setdefault(name, values[i].item())
            for name, values in result.extra.items():
                row.setdefault(name, _plain(values[i]))
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def pick_val_generations(
    inputs: Sequence[str], outputs: Sequence[str], scores: Sequence[float], count: int
) -> list[tuple[str, str, float]]:
    """verl's choice of ``trainer.log_val_generations`` samples: (input, output, score) sorted
    by input, shuffled by ``numpy.random.RandomState(42)``, the first ``count``; the same
    samples at every validation of a run while the inputs do not change."""
    import numpy as np

    samples = sorted(zip(inputs, outputs, scores, strict=True), key=lambda x: x[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:count]


def write_val_generations(
    run_dir: Path, step: int, samples: Sequence[tuple[str, str, float]]
) -> None:
    """Append one line ``{"step", "samples": [{"input", "output", "score"}, ...]}`` to the run
    directory's :data:`VAL_GENERATIONS` (verl logs the same samples as a table to wandb,
    MLflow or TensorBoard)."""
    line = {"step": step, "samples": [{"input": i, "output": o, "score": _plain(float(s))}
                                      for i, o, s in samples]}  # fmt: skip
    with (Path(run_dir) / VAL_GENERATIONS).open("a") as f:
        f.write(json.dumps(line) + "\n")
