"""Several ``megarl.trainer`` runs in one torchrun launch (importing Megatron costs ~10 s a
process): each run of the spec is the trainer's own loop (``megarl.trainer.loop.run``, what
``megarl train`` starts on every rank) on a config with overrides; a run with ``resume_from``
starts in a fresh directory holding a copy of that run's checkpoint of the given step. Rank 0
writes the exit codes: ``python -m torch.distributed.run --nproc_per_node W _dapo_worker.py SPEC``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main() -> None:
    import torch.distributed as dist

    from megarl.config import load_config
    from megarl.trainer.loop import run

    spec = json.loads(Path(sys.argv[1]).read_text())
    tmp = Path(spec["tmp"])
    codes = {}
    for one in spec["runs"]:
        run_dir = tmp / one["name"]
        if "resume_from" in one and (not dist.is_initialized() or dist.get_rank() == 0):
            source, step = one["resume_from"]
            shutil.copytree(tmp / source / f"global_step_{step}", run_dir / f"global_step_{step}")
            (run_dir / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
        if dist.is_initialized():
            dist.barrier()
        overrides = [*spec["overrides"], *one["overrides"], f"trainer.default_local_dir={run_dir}"]
        codes[one["name"]] = run(load_config([spec["config"]], overrides))
    if not dist.is_initialized() or dist.get_rank() == 0:
        (tmp / "codes.json").write_text(json.dumps(codes))


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
