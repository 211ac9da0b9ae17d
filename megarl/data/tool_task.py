"""The tool task ``megarl/tool_mul``: multiply two 2-digit numbers, which a tiny model cannot do,
where only a calculator call gets the reward.

A prompt is one chat message ``what is {a} times {b} ?`` with ``a, b`` in ``[32, 99]`` (the
product always has 4 digits). The reward (:func:`compute_score`, a ``custom_reward_function``)
is 0.5 when a calculator turn answered the exact product (the call copied both operands) plus
0.5 × the share of the final answer's digits right (the copy of the tool's result); nothing
without such a call, so a guess, even a right one, earns nothing.

The warm start (:func:`warm_start_conversations`, :mod:`megarl.tools.warm_start`) leaves RL
room on purpose: 3 in 8 of its conversations call ``calculator`` with ``a*b`` and answer with
the tool's result, the other 5 guess (``about 4821``). The warm-started model samples a call
about 3 times in 8, and greedy decoding guesses, so greedy validation starts near 0; RL has to
learn to call the tool (and to copy operands and result right, which the short warm start does
only in part).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

__all__ = [
    "CALLS_PER_8",
    "DATA_SOURCE",
    "compute_score",
    "make_tool_rows",
    "warm_start_conversations",
    "write_tool_data",
]

DATA_SOURCE = "megarl/tool_mul"
LOW, HIGH = 32, 99
CALLS_PER_8 = 3
"""Warm-start conversations that call the tool, in each block of 8 (the rest guess)."""
_LEADING = re.compile(r"\s*([0-9]+)")
_TOOL_TURN = re.compile(r"(?:^|\n)tool\n(.*?)\nassistant\n", re.DOTALL)


def _question(rng: random.Random) -> tuple[int, int]:
    return rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)


def _prompt(a: int, b: int) -> str:
    return f"what is {a} times {b} ?"


def make_tool_rows(n: int, *, split: str, seed: int) -> list[dict]:
    """``n`` rows in verl's schema (``data_source``, ``prompt``, ``ability``, ``reward_model``,
    ``extra_info``; no ``tools_kwargs``: the calculator needs none)."""
    rng = random.Random(f"{seed}:{split}:mul")
    rows = []
    for i in range(n):
        a, b = _question(rng)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": _prompt(a, b)}],
                "ability": "tool_arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                "extra_info": {"split": split, "index": i, "a": a, "b": b},
            }
        )
    return rows


def write_tool_data(out: str | Path, *, train: int = 256, test: int = 64, seed: int = 0) -> Path:
    """``train.parquet`` and ``test.parquet`` under ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train), ("test", test)):
        pq.write_table(pa.Table.from_pylist(make_tool_rows(n, split=split, seed=seed)),
                       out / f"{split}.parquet")  # fmt: skip
    return out


def warm_start_conversations(n: int, *, seed: int = 1) -> list[list[dict]]:
    """``n`` conversations of the task: in each block of 8, :data:`CALLS_PER_8` call the
    calculator with ``a*b`` and answer with its result (written exactly as the tool writes it),
    the others answer ``about <a 4-digit guess>``."""
    rng = random.Random(f"warm:{seed}:mul")
    out = []
    for start in range(0, n, 8):
        calls = set(rng.sample(range(8), CALLS_PER_8))
        for k in range(min(8, n - start)):
            a, b = _question(rng)
            user = {"role": "user", "content": _prompt(a, b)}
            if k not in calls:
                guess = f"about {rng.randint(1000, 9999)}"
                out.append([user, {"role": "assistant", "content": guess}])
                continue
            call = (
                '<tool_call>{"name": "calculator", "arguments": {"expression": "'
                f'{a}*{b}"}}}}</tool_call>'
            )
            out.append(
                [
                    user,
                    {"role": "assistant", "content": call},
                    {"role": "tool", "content": str(a * b)},
                    {"role": "assistant", "content": str(a * b)},
                ]
            )
    return out


def final_answer(solution_str: str) -> str:
    """The last assistant turn's text of a decoded multi-turn response (special tokens
    dropped, role names kept: ``...tool\\n2146\\nassistant\\n2146``)."""
    return solution_str.rsplit("assistant\n", 1)[-1]


def tool_answers(solution_str: str) -> list[str]:
    """The tool turns' texts of a decoded multi-turn response (``...tool\n<text>\nassistant\n``)."""
    return [m.strip() for m in _TOOL_TURN.findall(solution_str)]


def _digit_credit(answer: str, truth: str) -> float:
    """The share of ``truth``'s digits ``answer`` has in place, over the longer of the two."""
    right = sum(x == y for x, y in zip(answer, truth, strict=False))
    return right / max(len(answer), len(truth), 1)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any
) -> dict[str, float]:
    """0.5 when a tool turn held the exact product (``tool_ok``), plus 0.5 × the per-digit
    credit of the last assistant turn's leading number (``digits``) when it did. A direct
    answer, even right, gets 0: only the calculator knows. ``acc``: the final answer is the
    product (with or without the tool)."""
    truth = str(ground_truth)
    tool_ok = truth in tool_answers(solution_str)
    match = _LEADING.match(final_answer(solution_str))
    answer = match.group(1) if match else ""
    digits = _digit_credit(answer, truth)
    return {
        "score": 0.5 * tool_ok + 0.5 * digits * tool_ok,
        "acc": float(answer == truth),
        "tool_ok": float(tool_ok),
        "digits": digits,
    }
