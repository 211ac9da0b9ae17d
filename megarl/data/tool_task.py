"""The tool task ``megarl/tool_sum``: add two numbers too long for a tiny model to add, where
only a calculator call gets the reward.

A prompt is one chat message ``what is {a} plus {b} ?`` with ``a, b`` of ``digits`` digits (6 by
default). The reward (:func:`compute_score`, a ``custom_reward_function``) is half the credit of the
call's operands and half the per-digit credit of the final answer when the tool answered the
exact sum; nothing without a call. A warm-started
tiny model (:func:`warm_start_conversations`, :mod:`megarl.tools.warm_start`) has seen the
format: call ``calculator`` with ``a+b``, then answer with the tool's result.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

__all__ = [
    "DATA_SOURCE",
    "compute_score",
    "make_tool_rows",
    "warm_start_conversations",
    "write_tool_data",
]

DATA_SOURCE = "megarl/tool_sum"
_LEADING = re.compile(r"\s*([0-9]+)")
_EXPRESSION = re.compile(r'"expression":\s*"([^"]*)"')
_TOOL_TURN = re.compile(r"(?:^|\n)tool\n(.*?)\nassistant\n", re.DOTALL)


def _question(rng: random.Random, digits: int) -> tuple[int, int]:
    low, high = 10 ** (digits - 1), 10**digits - 1
    return rng.randint(low, high), rng.randint(low, high)


def make_tool_rows(n: int, *, split: str, seed: int, digits: int = 6) -> list[dict]:
    """``n`` rows in verl's schema (``data_source``, ``prompt``, ``ability``, ``reward_model``,
    ``extra_info``; no ``tools_kwargs``: the calculator needs none)."""
    rng = random.Random(f"{seed}:{split}:{digits}")
    rows = []
    for i in range(n):
        a, b = _question(rng, digits)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"what is {a} plus {b} ?"}],
                "ability": "tool_arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i, "a": a, "b": b},
            }
        )
    return rows


def write_tool_data(out: str | Path, *, train: int = 256, test: int = 64, seed: int = 0,
                    digits: int = 6) -> Path:  # fmt: skip
    """``train.parquet`` and ``test.parquet`` under ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train), ("test", test)):
        rows = make_tool_rows(n, split=split, seed=seed, digits=digits)
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
    return out


def warm_start_conversations(n: int, *, seed: int = 1, digits: int = 6) -> list[list[dict]]:
    """``n`` conversations of the task's format, the calculator's answers written exactly as
    the tool writes them (an integer)."""
    rng = random.Random(f"warm:{seed}:{digits}")
    out = []
    for _ in range(n):
        a, b = _question(rng, digits)
        call = (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "'
            f'{a}+{b}"}}}}</tool_call>'
        )
        out.append(
            [
                {"role": "user", "content": f"what is {a} plus {b} ?"},
                {"role": "assistant", "content": call},
                {"role": "tool", "content": str(a + b)},
                {"role": "assistant", "content": str(a + b)},
            ]
        )
    return out


def final_answer(solution_str: str) -> str:
    """The last assistant turn's text of a decoded multi-turn response (special tokens
    dropped, role names kept: ``...tool\\n579\\nassistant\\n579``)."""
    return solution_str.rsplit("assistant\n", 1)[-1]


def tool_answers(solution_str: str) -> list[str]:
    """The tool turns' texts of a decoded multi-turn response (``...tool\n<text>\nassistant\n``)."""
    return [m.strip() for m in _TOOL_TURN.findall(solution_str)]


def _credit(answer: str, truth: str) -> float:
    """The share of ``truth``'s characters ``answer`` has in place, over the longer of the two."""
    right = sum(x == y for x, y in zip(answer, truth, strict=False))
    return right / max(len(answer), len(truth), 1)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any
) -> dict[str, float]:
    """Half for the call, half for the answer, and nothing without a call:

    - 0.5 × the character credit of the last call's ``expression`` against ``a+b`` (the
      operands from ``extra_info``; 0 when the response has no expression);
    - 0.5 × the per-digit credit of the last assistant turn's number, only when a calculator
      turn answered the exact sum (the answer must come from the tool).

    A direct answer, even right, gets 0: a tiny model would collect digit credit by guessing.
    ``acc``: the final answer is the exact sum; ``tool_ok``: a tool turn held it."""
    truth = str(ground_truth)
    info = extra_info or {}
    expressions = _EXPRESSION.findall(solution_str)
    call = (
        _credit(expressions[-1], f"{info['a']}+{info['b']}") if expressions and "a" in info else 0.0
    )
    tool_ok = truth in tool_answers(solution_str)
    match = _LEADING.match(final_answer(solution_str))
    answer = match.group(1) if match else ""
    return {
        "score": 0.5 * call + (0.5 * _credit(answer, truth) if tool_ok else 0.0),
        "acc": float(answer == truth),
        "tool_ok": float(tool_ok),
    }
