"""The tool demo (``make demo-tools``): ``configs/grpo_tools_tiny_cpu.yaml`` from nothing.

    python tools/run_tool_task.py [--out outputs] [--remake] [KEY=VALUE ...]

Makes the tool task (``tools/make_tool_task.py``: the data and a tiny Qwen2 warm-started to call
the calculator, in ``OUT/tool-task``) when it is missing, then trains the config with 2
processes through ``megarl train`` (multi-turn rollouts with vLLM colocated, greedy validation
with tools before training and every 10 steps). ``actor_rollout_ref.actor.optim.lr=0`` gives
the control run. docs/tools.md, "The tool task".
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "grpo_tools_tiny_cpu.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs", help="where the task and the run go")
    parser.add_argument("--remake", action="store_true", help="make the task even if it exists")
    args, overrides = parser.parse_known_args(argv)
    out = Path(args.out).resolve()
    task = out / "tool-task"
    if args.remake or not (task / "tiny-qwen2" / "model.safetensors").exists():
        from tools.make_tool_task import make_tool_task

        print(f"megarl: making the tool task in {task}", flush=True)
        done = make_tool_task(task)
        print(f"megarl: warm start {done['seconds']:.1f} s (loss {done['loss']:.3f})", flush=True)
    from megarl.commands import train

    os.chdir(REPO)  # the config's tool file and reward function are repository paths
    return train.main([
        "--config", str(CONFIG),
        f"actor_rollout_ref.model.path={task / 'tiny-qwen2'}",
        f"data.train_files={task / 'data' / 'train.parquet'}",
        f"data.val_files={task / 'data' / 'test.parquet'}",
        f"trainer.default_local_dir={out / 'runs' / CONFIG.stem}",
        *overrides,
    ])  # fmt: skip


if __name__ == "__main__":
    from megarl.parallel.fast_exit import exit_process

    exit_process(main())
