"""Training entry point: ``torchrun --nproc_per_node N -m megarl.train --config X.yaml [k=v ...]``.

Also reached as ``megarl train``. Kept light to import: dist-checkpointing's writer starts a
``spawn``-context helper process that re-imports the launching module, so nothing
heavy happens at import time and all work sits under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from megarl.config import ConfigError, load_config, validate
from megarl.planner import memory_warnings

EXIT_CONFIG_ERROR = 2


def run(config_paths: Sequence[str], overrides: Sequence[str]) -> int:
    """Load, validate (files and world size included) and train; returns the exit status."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # started by torchrun: never outlive it
        from megarl.checkpoint.processes import die_with_parent

        die_with_parent(os.getppid())  # the kernel's SIGKILL when torchrun dies (kill -9 too)
    try:
        cfg = load_config(list(config_paths), list(overrides))
        world_size = None
        if os.environ.get("WORLD_SIZE"):  # the training ranks: the launch's less rollout-only ones
            from megarl.config.batch import rollout_ranks

            world_size = int(os.environ["WORLD_SIZE"]) - rollout_ranks(cfg)
        warnings = validate(cfg, world_size, check_paths=True)
        warnings += memory_warnings(cfg, world_size)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if os.environ.get("RANK", "0") == "0":
        for message in warnings:
            print(f"warning: {message}", file=sys.stderr)
    from megarl import trainer
    from megarl.parallel.gate import pass_gate

    pass_gate(trainer.preload)  # ``megarl train`` checks the run meanwhile
    result = trainer.main(cfg)
    return result if isinstance(result, int) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megarl.train",
        description="Run PPO/GRPO training (one process per device, under torchrun or srun).",
        usage="%(prog)s [-c FILE ...] [KEY=VALUE ...]",
    )
    # No file: verl's defaults (ppo_megatron_trainer.yaml) plus the overrides, as a verl script.
    parser.add_argument("-c", "--config", action="append", default=[], metavar="FILE")
    args, overrides = parser.parse_known_args(argv)
    bad = [a for a in overrides if a.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    return run(args.config, overrides)


if __name__ == "__main__":
    from megarl.parallel.fast_exit import exit_process

    exit_process(main())
