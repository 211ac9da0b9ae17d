"""The PPO/GRPO trainer. A rank starts in :func:`start` (``torchrun -m megarl.trainer``), which
checks the config and hands it to :func:`megarl.trainer.loop.run`; each step is
:func:`megarl.trainer.step.train_step`.

Kept light to import: dist-checkpointing's writer starts a ``spawn``-context helper process
that re-imports the launching module, so nothing heavy happens at import time.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

EXIT_CONFIG_ERROR = 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m megarl.trainer [-c FILE ...] [KEY=VALUE ...]``: one rank; returns its exit
    status."""
    parser = argparse.ArgumentParser(
        prog="python -m megarl.trainer",
        description="Run PPO/GRPO training (one process per device, under torchrun or srun).",
        usage="%(prog)s [-c FILE ...] [KEY=VALUE ...]",
    )
    # No file: verl's defaults (ppo_megatron_trainer.yaml) plus the overrides, as a verl script.
    parser.add_argument("-c", "--config", action="append", default=[], metavar="FILE")
    args, overrides = parser.parse_known_args(argv)
    bad = [a for a in overrides if a.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    return start(args.config, overrides)


def start(config_paths: Sequence[str], overrides: Sequence[str]) -> int:
    """Load and check the config (files and world size included), wait at the launcher's gate,
    then run; returns the exit status."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # started by torchrun: never outlive it
        from megarl.checkpoint.processes import TORCHRUN_PID_ENV, die_with_parent

        # The kernel's SIGKILL when torchrun dies (kill -9 too). The torchrun ``megarl train``
        # started is named: if it died before this line (a refused pre-flight), exit now
        # rather than arm the signal against the process that adopted this one.
        torchrun = os.environ.pop(TORCHRUN_PID_ENV, "")
        die_with_parent(int(torchrun) if torchrun.isdigit() else os.getppid())
    from megarl.config import ConfigError, load_config, validate
    from megarl.planner import memory_warnings

    try:
        cfg = load_config(list(config_paths), list(overrides))
        world_size = None
        if os.environ.get("WORLD_SIZE"):  # the training ranks: the launch's less rollout-only ones
            from megarl.config.batch_plan import rollout_ranks, teacher_ranks

            world_size = int(os.environ["WORLD_SIZE"]) - rollout_ranks(cfg) - teacher_ranks(cfg)
        warnings = validate(cfg, world_size, check_paths=True)
        warnings += memory_warnings(cfg, world_size)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if os.environ.get("RANK", "0") == "0":
        for message in warnings:
            print(f"warning: {message}", file=sys.stderr)
    from megarl.reward.scorers import sandbox

    sandbox.configure(cfg.reward.code_sandbox)  # scoring workers and tools inherit it
    from megarl.parallel.gate import pass_gate

    pass_gate(preload)  # ``megarl train`` checks the run meanwhile
    from megarl.trainer.loop import run

    return run(cfg)


def preload() -> None:
    """Import what a rank's set-up needs (torch, Megatron, transformers' tokenizers; ~10 s), as
    ranks do while ``megarl train``'s pre-flight runs. No other effect."""
    from transformers import AutoTokenizer  # noqa: F401 -- the lazy module loads here

    import megarl.tracking
    import megarl.trainer.setup
    import megarl.trainer.step  # noqa: F401
