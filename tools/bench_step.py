"""Where the tiny CPU GRPO step spends its time: each phase's seconds and share, over several steps.

Runs the README's main job (``megarl.commands.quickstart``: 2 processes, actor TP 2, vLLM TP 2)
for ``--steps`` steps without validation, then reads ``timing_s/*`` from the run's
``metrics.jsonl``. The first step is reported apart (vLLM's first generation compiles and warms
up); the table averages the others. "bookkeeping" is the step minus its timed phases (metrics,
batch tensors, Python).

    .venv/bin/python tools/bench_step.py [--steps 8] [--out outputs] [KEY=VALUE ...]
    .venv/bin/python tools/bench_step.py algorithm.adv_estimator=gae    # PPO: critic phases
    .venv/bin/python tools/bench_step.py --config configs/ppo_tiny_cpu.yaml  # the PPO tiny run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

PHASES = (
    "gen", "gen_baseline", "reward", "old_log_prob", "ref", "values", "adv", "update_critic",
    "update_actor", "update_weights",
)  # fmt: skip
"""Timed phases of the step (``timing_s/<phase>``); those a run does not have are left out."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="outputs")
    parser.add_argument(
        "--from", dest="existing", metavar="RUN_DIR", help="report an existing run instead"
    )
    args, overrides = parser.parse_known_args()
    if args.existing:
        return report(Path(args.existing), args.steps)
    run_dir = Path(args.out).resolve() / "runs" / "bench_step"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no resume from an earlier bench
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl.commands.quickstart",
            "--out",
            args.out,
            f"trainer.total_training_steps={args.steps}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={run_dir}",
            *overrides,
        ],
        check=False,
    )
    if done.returncode:
        return done.returncode
    return report(run_dir, args.steps)


def report(run_dir: Path, last: int) -> int:
    """Print the phase table of the last ``last`` steps of the run in ``run_dir``."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["metrics"] for r in records if r["step"] > 0 and "timing_s/step" in r["metrics"]]
    steps = steps[-last:]
    first, rest = steps[0], steps[1:] or steps
    step_time = statistics.mean(m["timing_s/step"] for m in rest)
    print(
        f"\nfirst step {first['timing_s/step']:.2f} s (vLLM warm-up: gen {first['timing_s/gen']:.2f} s)"
    )
    print(f"steps 2..{len(steps)}: {step_time:.3f} s per step\n")
    print(f"{'phase':<16}{'seconds':>10}{'share':>9}")
    timed = 0.0
    for phase in PHASES:
        if not any(f"timing_s/{phase}" in m for m in rest):
            continue
        values = [m.get(f"timing_s/{phase}", 0.0) for m in rest]
        mean = statistics.mean(values)
        timed += mean
        print(f"{phase:<16}{mean:>10.3f}{mean / step_time:>9.1%}")
    other = step_time - timed
    print(f"{'bookkeeping':<16}{other:>10.3f}{other / step_time:>9.1%}")
    tokens = statistics.mean(m["perf/total_num_tokens"] for m in rest)
    print(f"\n{tokens:.0f} tokens per step; {tokens / step_time:.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
