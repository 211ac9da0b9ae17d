"""The README's main command (``make demo``): a tiny GRPO run on CPU, from nothing.

    python -m megarl.commands.quickstart [--out outputs] [--config CONFIG] [KEY=VALUE ...]

Makes the tiny random checkpoint (``outputs/tiny-qwen2``) and the synthetic task's data
(``outputs/tiny-data``) when they are missing, then trains ``configs/grpo_tiny_cpu.yaml`` with 2
processes through ``megarl train`` (its pre-flight, stop protocol and one-line failures). The
Mixture-of-Experts variant: ``--config configs/grpo_moe_tiny_cpu.yaml --family qwen3_moe``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "grpo_tiny_cpu.yaml"


def main(argv: list[str] | None = None) -> int:
    from megarl.models.tiny_families import ARCHITECTURES  # torch-free: nothing waits on it

    parser = argparse.ArgumentParser(
        prog="python -m megarl.commands.quickstart", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", default="outputs", help="where model, data and the run go")
    parser.add_argument("--nproc", type=int, default=2, help="processes (the config's world)")
    parser.add_argument(
        "--config", default=str(CONFIG), help="the run's config (a 2-rank tiny one)"
    )
    parser.add_argument(
        "--family",
        default="qwen2",
        choices=sorted(ARCHITECTURES),
        help="the tiny model's family (qwen3_moe with configs/grpo_moe_tiny_cpu.yaml)",
    )
    args, overrides = parser.parse_known_args(argv)
    out = Path(args.out).resolve()
    model, data = out / f"tiny-{args.family.replace('_', '-')}", out / "tiny-data"
    py = sys.executable
    if not (model / "config.json").exists():
        print(f"megarl: making the tiny model in {model}", flush=True)
        subprocess.run(
            [py, str(REPO / "tools/make_tiny_model.py"), "--family", args.family,
             "--out", str(model)],
            check=True,
            capture_output=True,
        )  # fmt: skip
    if not (data / "train.parquet").exists():
        from megarl.data.synthetic import write_synthetic_data

        write_synthetic_data(data)
        print(f"megarl: wrote the synthetic task's data to {data}", flush=True)
    # Through ``megarl train``: its pre-flight checks, the stop protocol (Ctrl-C saves the
    # step in flight), and a failure inside the ranks as one line.
    from megarl.commands import train

    os.chdir(REPO)  # as before: the ranks run from the repository (relative overrides too)
    return train.main([
        "--config", str(Path(args.config).resolve()),
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"trainer.default_local_dir={out / 'runs' / Path(args.config).stem}",
        f"trainer.n_gpus_per_node={args.nproc}",
        *overrides,
    ])  # fmt: skip


if __name__ == "__main__":
    from megarl.parallel.fast_exit import exit_process

    exit_process(main())
