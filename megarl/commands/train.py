"""``megarl train``: check a run before launching it, then launch it on this machine.

Inside a launched world (``WORLD_SIZE`` set: torchrun, srun) it trains in this process. Otherwise
it first checks what would otherwise fail on every rank — the config with its files and world
size, the data files (read and tokenised: a missing file, an overlong prompt with
``truncation=error``), what the trainer runs, the checkpoint a resume would load (missing, or
of another architecture) — and answers a problem in one line with exit 2,
then starts ``torchrun --standalone`` with ``trainer.n_gpus_per_node`` processes through
:mod:`megarl.commands.launch`: SIGINT, SIGTERM and SIGUSR1 become the trainer's stop request
(a checkpoint of the step in flight, exit 0; a second signal stops at once), torchrun's own
output goes to the run's log directory, and a failure inside the ranks is one line.
``MEGARL_TRAIN_MODULE`` replaces the module torchrun runs (``megarl.train``).

    megarl train -c X.yaml [-c Y.yaml] [KEY=VALUE ...] [--verbose]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_INPUT_ERROR = 2


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megarl train", description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", action="append", required=True, metavar="FILE")
    parser.add_argument(
        "--verbose", action="store_true", help="show third-party output (vLLM, Megatron) too"
    )
    args, overrides = parser.parse_known_args(argv)
    bad = [a for a in overrides if a.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if args.verbose:
        os.environ["MEGARL_VERBOSE"] = "1"
    from megarl import train

    if os.environ.get("WORLD_SIZE"):
        return train.run(args.config, overrides)
    problem, nproc, run_dir = preflight(args.config, overrides)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    from megarl.commands.launch import run_torchrun, torchrun_command

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    module = os.environ.get("MEGARL_TRAIN_MODULE") or "megarl.train"
    configs = [f"--config={c}" for c in args.config]
    return run_torchrun(torchrun_command(nproc, module, [*configs, *overrides]), env, run_dir)


def preflight(configs: list[str], overrides: list[str]) -> tuple[str | None, int, Path]:
    """(the first problem as one line or None, processes to launch, the run directory)."""
    from megarl.config import ConfigError, load_config, validate

    try:
        cfg = load_config(configs, overrides)
        if cfg.trainer.nnodes > 1:
            reason = (
                f"trainer.nnodes={cfg.trainer.nnodes}: a multi-node run is launched by Slurm "
                "(launch/*.slurm) or torchrun on every node, not by megarl train"
            )
            return reason, 0, Path()
        nproc = cfg.trainer.n_gpus_per_node
        validate(cfg, nproc, check_paths=True)
    except ConfigError as exc:
        return " ".join(str(exc).split()), 0, Path()
    from megarl.checkpoint.resume import resume_problem

    run_dir = run_dir_of(cfg)
    if (reason := resume_problem(cfg, run_dir)) is not None:
        return reason, nproc, run_dir
    return _check_data(cfg), nproc, run_dir


def run_dir_of(cfg) -> Path:
    """The run directory (``trainer.default_local_dir``), absolute."""
    return Path(cfg.trainer.default_local_dir).expanduser().resolve()


def _check_data(cfg) -> str | None:
    """Read and tokenise the prompt files as every rank will (one line on a problem)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from megarl.data import PromptDataset

    model = cfg.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(
        str(Path(model.tokenizer_path or model.path).expanduser())
    )
    splits = ["train"] + (["val"] if cfg.data.val_files else [])
    try:
        for split in splits:
            PromptDataset.from_config(cfg.data, tokenizer, split, cfg.trainer.seed)
    except (ValueError, OSError) as exc:
        return " ".join(str(exc).split())
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
