"""Training steps through the trainer's own calls, colocated (world 2) or with vLLM on ranks of
its own (world 3 or 4: a split launch, megarl.parallel.split_world, whose first 2 ranks train; the
rollout ranks serve the trainer's commands, megarl.rollout.remote_engine). Rank 0 saves each
step's metrics, responses and rewards, and the actor's final weights (HF names), to
``<tmp>/<mode>.pt``:

    torchrun --nproc_per_node 2|3|4 _disagg_worker.py SPEC.json MODE

Modes: ``colocated`` and ``split`` (2 steps, staleness 0, the tiny MoE with R3); ``split_off``
(3 ReMax steps one step off: each step asks for the next batch as soon as its own is in; the
4th batch, asked for by step 3, is one whose scorer raises, and step 4 records the error the
trainer raises) and its reference ``colocated_off``: colocated, but the sync after step k loads
the weights step k started from (taken before its update), so that batch k+1 comes from step
k-1's weights, as one step off.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 2


def _sync_with_the_weights_of_now(run) -> None:
    """Make this step's closing sync load the weights the actor has now, before its update."""
    from megarl.rollout.base import update_weights
    from megarl.trainer import step as step_module
    from tests.trainer._update_worker import _hf_weights

    now = _hf_weights(run.actor.chunks, run.actor.model.dims)
    step_module.sync_engine = lambda run: update_weights(run.engine, now.items())


def main() -> None:
    spec, mode = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]
    from megarl.config import load_config
    from megarl.config.loader import resolve_config
    from megarl.trainer.console import Console

    off = mode.endswith("_off")  # the one-step-off pair: the dense model at PP 2; else the MoE
    config = spec["config"] if off else spec["on_config"]
    overrides = spec["overrides"] + (spec["off_overrides"] if off else spec["on_overrides"])
    cfg = resolve_config(load_config([config], overrides))
    if mode.startswith("split"):
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
            steps = STEPS + 1 if off else STEPS
            batches = [[run.train_data[i] for i in next(run.sampler)] for _ in range(steps + 1)]
            if mode == "split_off":  # the batch after the last: its scorer raises (see below)
                poison = [s.extra_info["index"] for s in batches[steps]]
                Path(spec["tmp"], "poison.json").write_text(json.dumps(poison))
            for step in range(1, steps + 1):
                if mode == "colocated_off":
                    _sync_with_the_weights_of_now(run)
                after = batches[step] if mode == "split_off" else None
                metrics, batch = train_step(run, step, batches[step - 1], after)
                out["steps"].append({
                    "metrics": metrics,
                    "responses": batch.responses.tolist() if hasattr(batch, "responses") else None,
                    "input_ids": batch.input_ids.tolist(),
                    "rewards": batch.fields["token_level_rewards"].sum(-1).tolist(),
                })  # fmt: skip
            out["weights"] = _hf_weights(run.actor.chunks, run.actor.model.dims)
            out["world"] = dist.get_world_size()
            if mode == "split_off":
                # The last step asked for one more batch, which the rollout rank scored while
                # that step trained: its scorer's error reaches the trainer at the next step.
                from megarl.reward.manager import RewardError

                try:
                    train_step(run, steps + 1, batches[steps], None)
                except RewardError as exc:
                    out["scorer_error"] = str(exc)
        finally:
            run.rewards.close()
            if mode.startswith("split"):
                run.engine.shutdown()
    if dist.get_rank() == 0:
        torch.save(out, Path(spec["tmp"]) / f"{mode}.pt")
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
