"""Two training steps through the trainer's own calls, colocated (world 2) or with vLLM on a rank
of its own (world 3: a split launch, megarl.parallel.split_world; the rollout rank serves the
trainer's commands, megarl.rollout.remote_engine). Rank 0 saves each step's metrics, responses
and rewards, and the actor's final weights (HF names), to ``<tmp>/<mode>.pt``:

    torchrun --nproc_per_node 2|3 _disagg_worker.py SPEC.json colocated|split
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 2


def main() -> None:
    spec, mode = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]
    from megarl.config import load_config
    from megarl.config.loader import resolve_config
    from megarl.trainer.console import Console

    cfg = resolve_config(load_config([spec["config"]], spec["overrides"]))
    if mode == "split":
        from megarl.parallel.split_world import split_world

        world = split_world(2)
        if world.role == "rollout":
            from megarl.trainer.setup import serve_rollout

            serve_rollout(cfg)
            return
    from megarl.parallel.init import destroy_distributed
    from megarl.trainer.setup import build_run
    from megarl.trainer.step import first_sync, train_step
    from tests.trainer._update_worker import _hf_weights

    run_dir = Path(spec["tmp"]) / mode
    out: dict = {"steps": []}
    with Console(run_dir / "logs", rank=dist.get_rank() if dist.is_initialized() else 0) as c:
        run = build_run(cfg, c, run_dir)
        try:
            first_sync(run)
            for step in range(1, STEPS + 1):
                metrics, batch = train_step(
                    run, step, [run.train_data[i] for i in next(run.sampler)]
                )
                out["steps"].append({
                    "metrics": metrics,
                    "responses": batch.responses.tolist() if hasattr(batch, "responses") else None,
                    "input_ids": batch.input_ids.tolist(),
                    "rewards": batch.fields["token_level_rewards"].sum(-1).tolist(),
                })  # fmt: skip
            out["weights"] = _hf_weights(run.actor.chunks, run.actor.model.dims)
            out["world"] = dist.get_world_size()
        finally:
            run.rewards.close()
            if mode == "split":
                run.engine.shutdown()
    if dist.get_rank() == 0:
        torch.save(out, Path(spec["tmp"]) / f"{mode}.pt")
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
