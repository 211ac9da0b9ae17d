"""The body of a scoring worker process: load the scorer by location, score one sample at a time.

A worker imports this module first, so it imports nothing heavy (no torch). Protocol on the
worker's end of the connection: it loads the scorer and sends ``("ready",)`` (or
``("failed", why)`` and exits); then it receives ``(index, data_source, solution_str,
ground_truth, extra_info)`` tuples (``None`` stops it) and answers each with
``("ok", index, score, fields)`` (``fields``: the other entries of a dict result) or
``("error", index, "ExceptionType: message")`` when the scorer raised or returned something
unusable.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from megarl.checkpoint.processes import die_with_parent
from megarl.reward.loader import ScorerSpec, load_scorer

__all__ = ["die_with_parent", "normalise_result", "serve", "serve_fd"]


class BadResult(TypeError):
    """A scorer returned neither a number (a bool counts) nor a dict with a numeric ``score``."""


def normalise_result(result: Any) -> tuple[float, dict[str, Any]]:
    """``(score, other fields)`` of a scorer's return value (verl: a number, or a dict with
    ``score``). A bool (Python's or numpy's) counts as 1.0 / 0.0, as verl's reward tensor
    takes it."""
    if isinstance(result, dict):
        if "score" not in result:
            raise BadResult(f"returned a dict without 'score' (keys {sorted(result)})")
        score, fields = result["score"], {k: v for k, v in result.items() if k != "score"}
    else:
        score, fields = result, {}
    if _is_bool(score):
        return float(bool(score)), fields
    if not isinstance(score, numbers.Real):
        raise BadResult(
            f"returned score {score!r} of type {type(score).__name__}, not a number or a bool"
        )
    if not math.isfinite(float(score)):
        raise BadResult(f"returned a non-finite score {score!r}")
    return float(score), fields


def _is_bool(value: Any) -> bool:
    """Python's bool, or a numpy bool scalar (no numpy import: a worker stays light)."""
    dtype = getattr(value, "dtype", None)
    return isinstance(value, bool) or (
        getattr(dtype, "kind", None) == "b" and getattr(value, "ndim", None) == 0
    )


def _score_one(fn: Callable[..., Any], spec: ScorerSpec, task: tuple, user=None) -> tuple:
    index, data_source, solution_str, ground_truth, extra_info = task[:5]
    if user is not None:  # a manager class of the user's: its run_single scores the sample
        try:
            reward_score, extra = user.score(task)
            score, fields = normalise_result({**extra, "score": reward_score})
        except Exception as exc:  # noqa: BLE001 -- reported to the parent, which fails the step
            first_line = (str(exc).strip().splitlines() or [""])[0]
            return ("error", index, f"{type(exc).__name__}: {first_line}")
        return ("ok", index, score, fields)
    if spec.manager == "prime":
        return ("ok", index, _prime_score(fn, spec, task), {})
    if spec.manager == "gdpo":  # verl's gdpo manager hands the experiment's name along
        extra_info = {**(extra_info or {}), "experiment_name": spec.experiment_name}
    try:
        result = fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **spec.reward_kwargs,
        )
        score, fields = normalise_result(result)
    except Exception as exc:  # noqa: BLE001 -- reported to the parent, which fails the step
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return ("error", index, f"{type(exc).__name__}: {first_line}")
    if spec.manager in ("dapo", "gdpo") and not isinstance(result, dict):
        fields = {"acc": score}  # verl's dapo and gdpo managers: a plain score is also "acc"
    return ("ok", index, score, fields)


def _prime_score(fn: Callable[..., Any], spec: ScorerSpec, task: tuple) -> float:
    """verl's prime manager: ``fn(data_source, solution_str, ground_truth, extra_info)``
    positionally; a raise (or an unusable result) scores 0; a number or bool is the score,
    otherwise the result's first entry."""
    _, data_source, solution_str, ground_truth, extra_info = task
    try:
        result = fn(data_source, solution_str, ground_truth, extra_info, **spec.reward_kwargs)
        if isinstance(result, int | float | bool) or _is_bool(result):
            return float(result)
        return float(result[0])
    except Exception:  # noqa: BLE001 -- verl's prime manager scores a failed row 0
        return 0.0


def serve_fd(fd: int, spec_json: str) -> None:
    """Entry point of a worker process: serve on socket ``fd`` the scorer ``spec_json`` names."""
    serve(Connection(fd), ScorerSpec(**json.loads(spec_json)))


def serve(conn: Connection, spec: ScorerSpec) -> None:
    """Load the scorer, report ``("ready",)`` (or ``("failed", why)`` and stop), then serve
    scoring requests on ``conn`` until ``None`` arrives or the parent goes away."""
    user = None
    try:
        fn = load_scorer(spec)
        if spec.manager == "importlib":
            from megarl.reward.user_manager import UserManager

            user = UserManager(spec, fn)
    except Exception as exc:  # noqa: BLE001 -- reported to the parent, which stops the pool
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready",))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        reply = _score_one(fn, spec, task, user)
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 -- e.g. a field that cannot be pickled
            conn.send(("error", task[0], f"result cannot be returned: {type(exc).__name__}: {exc}"))
