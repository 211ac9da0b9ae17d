"""The training loop: set up, validate, step, log, finish — with a quiet console.

``train(cfg)`` is what ``python -m megarl.train`` and ``megarl train`` run on every rank.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.config import MegarlConfig, to_dict, to_yaml
from megarl.trainer.console import Console

if TYPE_CHECKING:
    from megarl.trainer.setup import Run

# Megatron, vLLM and transformers are imported inside train(), after the console is redirected:
# some of them print warnings when imported.

SUMMARY_KEYS = (
    ("critic/score/mean", "score"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad_norm"),
    ("response_length/mean", "resp_len"),
    ("rollout/logprob_diff_max", "sync_diff"),
    ("timing_s/step", "s"),
)


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite updates): one line."""


def train(cfg: MegarlConfig, *, verbose: bool | None = None) -> int:
    """Run training; returns the exit status (0 finished, 1 failed)."""
    if verbose is None:
        verbose = os.environ.get("MEGARL_VERBOSE", "0") not in ("", "0")
    run_dir = Path(cfg.trainer.default_local_dir).expanduser().resolve()
    rank = int(os.environ.get("RANK", "0"))
    run: Run | None = None
    tracker = None
    with Console(run_dir / "logs", rank=rank, verbose=verbose) as console:
        try:
            from megarl.tracking import make_tracker
            from megarl.trainer.setup import build_run
            from megarl.trainer.step import validate

            run = build_run(cfg, console, run_dir)
            tracker = make_tracker(
                cfg, rank=run.rank, world_size=run.world_size, console_write=console.print
            )
            tracker.log_config(to_dict(cfg), to_yaml(cfg))
            _announce(run)
            first_val = last_val = None
            if run.val_data is not None and cfg.trainer.val_before_train:
                metrics = validate(run, 0)
                first_val = last_val = metrics["val/score/mean"]
                tracker.log_metrics(0, metrics)
            last_val = _loop(run, tracker, last_val)
            tracker.finish("FINISHED")
            _farewell(run, first_val, last_val)
            return 0
        except BaseException as exc:
            if tracker is not None:
                tracker.fail(exc)
            if isinstance(exc, KeyboardInterrupt):
                raise
            console.error(f"error: {_one_line(exc)} (details: {console.log_path})")
            if verbose or not isinstance(exc, TrainingError | ValueError | FileNotFoundError):
                import traceback

                traceback.print_exc()  # into the log file unless verbose
            return 1
        finally:
            if run is not None:
                run.rewards.close()


def _loop(run: Run, tracker, last_val: float | None) -> float | None:
    from tqdm import tqdm

    from megarl.trainer.step import train_step, validate

    cfg = run.cfg
    bar = tqdm(
        total=run.total_steps,
        initial=run.state.step,
        file=run.console.out,
        disable=run.rank != 0,
        desc="training",
        unit="step",
        dynamic_ncols=True,
    )
    limit = cfg.trainer.max_consecutive_skipped_steps
    for step in range(run.state.step + 1, run.total_steps + 1):
        prompts = [run.train_data[i] for i in next(run.sampler)]
        metrics, _ = train_step(run, step, prompts)
        run.state.step = step
        run.state.sampler = run.sampler.state_dict()
        skipped = metrics.get("actor/skipped_steps", 0.0)
        run.state.consecutive_skips = run.state.consecutive_skips + 1 if skipped else 0
        metrics["actor/consecutive_skipped_steps"] = float(run.state.consecutive_skips)
        test_freq = cfg.trainer.test_freq
        if (
            run.val_data is not None
            and test_freq > 0
            and (step % test_freq == 0 or step == run.total_steps)
        ):
            metrics.update(validate(run, step))
            last_val = metrics["val/score/mean"]
        tracker.log_metrics(step, metrics)
        bar.update(1)
        if limit > 0 and run.state.consecutive_skips >= limit:
            raise TrainingError(
                f"{run.state.consecutive_skips} consecutive steps had a non-finite gradient and "
                f"were skipped (trainer.max_consecutive_skipped_steps={limit})"
            )
    bar.close()
    return last_val


def summary_line(step: int, metrics: dict[str, float]) -> str:
    """``step 3 | score 0.210 | pg_loss -0.012 | ...``: a few keys, in a fixed order."""
    parts = [f"step {step}"]
    for key, label in SUMMARY_KEYS:
        if key in metrics and math.isfinite(metrics[key]):
            parts.append(f"{label} {metrics[key]:.4g}")
    return " | ".join(parts)


def _announce(run: Run) -> None:
    cfg = run.cfg
    meg = cfg.actor_rollout_ref.actor.megatron
    run.console.print(
        f"megarl: {cfg.algorithm.adv_estimator} on {cfg.actor_rollout_ref.model.path}, "
        f"{run.world_size} rank(s), TP {meg.tensor_model_parallel_size} × PP "
        f"{meg.pipeline_model_parallel_size} × DP {run.plan.data_parallel_size}, rollout "
        f"{cfg.actor_rollout_ref.rollout.name} TP "
        f"{getattr(run.engine, 'tensor_parallel_size', '-')}; {run.total_steps} steps of "
        f"{run.plan.responses_per_step} responses; logs in {run.console.log_path.parent}"
    )


def _farewell(run: Run, first: float | None, last: float | None) -> None:
    lines = [f"megarl: finished {run.state.step} steps; outputs in {run.run_dir}"]
    if first is not None and last is not None:
        lines.append(f"megarl: validation score {first:.4f} (before training) -> {last:.4f}")
    for line in lines:
        run.console.print(line)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) < 400 else text[:397] + "..."


def main_entry(cfg: MegarlConfig) -> int:
    """For ``megarl.train``: run and return the exit status (time-stamped on failure)."""
    start = time.time()
    status = train(cfg)
    if status and os.environ.get("RANK", "0") == "0":
        print(f"megarl: failed after {time.time() - start:.0f} s", file=sys.stderr)
    return status
