"""The synthetic verifiable task ``megarl/digit_sum``: add two numbers, answer with digits.

A prompt is one chat message ``what is {a} plus {b} ?`` with ``a, b`` uniform in
``0..max_operand`` (49 by default); the ground truth is ``str(a + b)``. The wording is the one
the tiny model's tokenizer was trained on (``megarl.models.tiny``), so prompts are a handful of
tokens. The reward (:func:`compute_score`) is shaped so that a randomly initialised tiny model
already scores some reward with spread in every group, and the first signal GRPO picks up
(starting the response with a number) is prompt-independent and learnt in a few dozen steps on
CPU; per-digit credit then rewards getting the sum's leading digit right.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

__all__ = [
    "DATA_SOURCE",
    "SyntheticTask",
    "compute_score",
    "make_rows",
    "write_synthetic_data",
]

DATA_SOURCE = "megarl/digit_sum"
ABILITY = "arithmetic"
_LEADING_DIGITS = re.compile(r"\s*([0-9]+)")


class SyntheticTask:
    """Parameters of the task: operand range and the per-split seeds."""

    def __init__(self, max_operand: int = 49) -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        self.max_operand = max_operand

    def question(self, rng: random.Random) -> tuple[str, str]:
        """A (question text, ground truth) pair."""
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return f"what is {a} plus {b} ?", str(a + b)


def make_rows(n: int, *, split: str, seed: int, task: SyntheticTask | None = None) -> list[dict]:
    """``n`` rows in verl's parquet schema (the layout of verl's ``gsm8k.py`` preprocessing)."""
    task = task or SyntheticTask()
    rng = random.Random(f"{seed}:{split}")
    rows = []
    for index in range(n):
        question, answer = task.question(rng)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": question}],
                "ability": ABILITY,
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "question": question},
            }
        )
    return rows


def write_synthetic_data(
    out_dir: str | Path,
    *,
    train_size: int = 4096,
    test_size: int = 256,
    seed: int = 0,
    max_operand: int = 49,
) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``test.parquet`` under ``out_dir``; returns both paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    task = SyntheticTask(max_operand)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, size in (("train", train_size), ("test", test_size)):
        if size < 1:
            raise ValueError(f"{split} size must be >= 1, got {size}")
        path = out / f"{split}.parquet"
        table = pa.Table.from_pylist(make_rows(size, split=split, seed=seed, task=task))
        pq.write_table(table, path)
        paths.append(path)
    return paths[0], paths[1]


def compute_score(solution_str: str, ground_truth: str, **_: Any) -> dict[str, float]:
    """``{"score", "format", "digits", "acc"}`` of one response, each in ``[0, 1]``.

    The response is decoded as verl does (special tokens skipped). The answer is the run of
    digits at its very start (leading whitespace skipped); with none, everything is 0.
    ``format`` = 1 when the answer exists; ``digits`` = positions where answer and ground truth
    hold the same digit (from the left) over the longer of the two lengths, so extra digits cost
    credit; ``score = 0.5 * format + 0.5 * digits``; ``acc``: the exact answer. Only the prefix
    counts, so the response length does not matter.
    """
    match = _LEADING_DIGITS.match(solution_str)
    if match is None:
        return {"score": 0.0, "format": 0.0, "digits": 0.0, "acc": 0.0}
    answer = match.group(1)
    same = sum(p == t for p, t in zip(answer, ground_truth, strict=False))
    digits = same / max(len(answer), len(ground_truth))
    return {
        "score": 0.5 + 0.5 * digits,
        "format": 1.0,
        "digits": digits,
        "acc": float(answer == ground_truth),
    }
