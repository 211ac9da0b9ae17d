"""Colocated against one step off (or ``--staleness`` steps, issue 26), side by side, with a
scorer that sleeps.

Two runs of the README's main job (``megarl.commands.quickstart``, the synthetic task) for
``--steps`` steps each, without validation, scoring with the task's own scorer plus a sleep of
``--sleep`` seconds per sample (an I/O-bound scorer: a code sandbox, a remote reward model):

- colocated: 2 ranks, actor TP 2, vLLM TP 2 on the same ranks, 2 scoring workers per rank;
- one step off: the same 2 training ranks plus 1 rank holding vLLM (TP 1), which generates and
  scores step k+1 while step k trains, with 4 scoring workers (the same 4 in all).

On 2 CPU cores training and generation share the cores, so the overlap cannot speed up the
compute; what it hides is the scorer's waiting: a colocated step lasts generation + scoring +
training, one step off lasts about the longer of (generation + scoring) and training. Prints
each run's mean step time (steps 2.., the first warms vLLM up), their ratio, each side's wait
(the training ranks' for the batch, the rollout rank's for the next request) as a share of the
step, and the phases.

    .venv/bin/python tools/bench_overlap.py [--steps 6] [--sleep 0.1] [--staleness 1] [--out D]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

SCORER = """
import time
from megarl.data.synthetic import compute_score as task_score

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    time.sleep({sleep})
    return task_score(solution_str, ground_truth)
"""
OWN_RANK = (
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "reward_model.num_workers=4",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sleep", type=float, default=0.1, help="seconds per scored sample")
    parser.add_argument("--staleness", type=int, default=1, help="steps off (1: one step off)")
    parser.add_argument("--out", default="outputs")
    args = parser.parse_args()
    off = "one step off" if args.staleness == 1 else f"{args.staleness} steps off"
    overlapped = (*OWN_RANK, f"async_training.staleness_threshold={args.staleness}")
    out = Path(args.out).resolve()
    scorer = out / "bench_overlap_scorer.py"
    scorer.parent.mkdir(parents=True, exist_ok=True)
    scorer.write_text(SCORER.format(sleep=args.sleep))
    runs = {}
    for name, extra in (("colocated", ()), (off, overlapped)):
        run_dir = out / "runs" / f"bench_overlap_{name.replace(' ', '_')}"
        shutil.rmtree(run_dir, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", "megarl.commands.quickstart", "--out", str(out),
             f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false",
             "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.resume_mode=disable",
             f"trainer.default_local_dir={run_dir}", f"custom_reward_function.path={scorer}",
             "custom_reward_function.name=compute_score", *extra],
            check=False,
        )  # fmt: skip
        if done.returncode:
            return done.returncode
        runs[name] = _steps(run_dir)
    _report(runs, args.sleep, off)
    return 0


def _steps(run_dir: Path) -> list[dict]:
    """The metrics of steps 2.. (the first warms vLLM up)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["metrics"] for r in records if r["step"] > 0 and "timing_s/step" in r["metrics"]]
    return steps[1:] or steps


def _mean(steps: list[dict], key: str) -> float:
    return statistics.mean(m.get(key, 0.0) for m in steps)


def _report(runs: dict[str, list[dict]], sleep: float, name_off: str) -> None:
    colocated, off = runs["colocated"], runs[name_off]
    t_co, t_off = _mean(colocated, "timing_s/step"), _mean(off, "timing_s/step")
    print(f"\nscorer sleep {sleep:g} s per sample; steps 2..{len(colocated) + 1}")
    print(f"{'':<16}{'step s':>9}{'gen':>8}{'reward':>8}{'update':>8}")
    for name, steps in runs.items():
        print(
            f"{name:<16}{_mean(steps, 'timing_s/step'):>9.2f}{_mean(steps, 'timing_s/gen'):>8.2f}"
            f"{_mean(steps, 'timing_s/reward'):>8.2f}{_mean(steps, 'timing_s/update_actor'):>8.2f}"
        )
    print(f"\n{name_off} / colocated step time: {t_off / t_co:.2f}")
    gen, score = _mean(off, "async/rollout_generate_s"), _mean(off, "async/rollout_score_s")
    print(
        f"{name_off}: the rollout rank generates {gen:.2f} s and scores {score:.2f} s per step; "
        f"the training ranks wait {_mean(off, 'async/wait_rollout_s') / t_off:.0%} of the step "
        f"for its batch and spend {_mean(off, 'timing_s/update_weights') / t_off:.0%} in the "
        f"weight update, {_mean(off, 'async/sync_wait_rollout_s') / t_off:.0%} of it waiting for "
        f"the batch asked before (at most one step off the update goes in after it), the "
        f"rollout rank {_mean(off, 'async/rollout_idle_s') / t_off:.0%} waits for the next request"
    )


if __name__ == "__main__":
    sys.exit(main())
