"""``megarl train``: check a run before launching it, then launch it on this machine.

Inside a launched world (``WORLD_SIZE`` set: torchrun, srun) it trains in this process. Otherwise
it first checks what would otherwise fail on every rank — the config with its files and world
size, the data files (read and tokenised: a missing file, an overlong prompt with
``truncation=error``), what the trainer runs, the checkpoint a resume would load (missing, or
of another architecture) — and answers a problem in one line with exit 2,
then starts ``torchrun --standalone`` with ``trainer.n_gpus_per_node`` processes (torchrun itself
prints a traceback whenever a worker fails, which is why the checks come first). SIGINT, SIGTERM
and SIGUSR1 are passed on to torchrun (the trainer's stop protocol).

    megarl train -c X.yaml [-c Y.yaml] [KEY=VALUE ...] [--verbose]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

EXIT_INPUT_ERROR = 2
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


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
    problem, nproc = preflight(args.config, overrides)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(nproc), "-m", "megarl.train",
        *(f"--config={c}" for c in args.config), *overrides,
    ]  # fmt: skip
    return run_forwarding_signals(command, env)


def run_forwarding_signals(command: list[str], env: dict[str, str]) -> int:
    """Run torchrun and hand it SIGINT/SIGTERM/SIGUSR1 (``subprocess.run`` would SIGKILL it on
    Ctrl-C and orphan its workers); torchrun passes them on to the ranks (stop protocol)."""
    child = subprocess.Popen(command, env=env)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def preflight(configs: list[str], overrides: list[str]) -> tuple[str | None, int]:
    """(the first problem as one line or None, processes to launch)."""
    from megarl.config import ConfigError, load_config, validate

    try:
        cfg = load_config(configs, overrides)
        if cfg.trainer.nnodes > 1:
            reason = (
                f"trainer.nnodes={cfg.trainer.nnodes}: a multi-node run is launched by Slurm "
                "(launch/*.slurm) or torchrun on every node, not by megarl train"
            )
            return reason, 0
        nproc = cfg.trainer.n_gpus_per_node
        validate(cfg, nproc, check_paths=True)
    except ConfigError as exc:
        return " ".join(str(exc).split()), 0
    from megarl.checkpoint.resume import resume_problem

    if (reason := resume_problem(cfg, run_dir_of(cfg))) is not None:
        return reason, nproc
    return _check_data(cfg), nproc


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
