"""Training steps through the trainer's own calls, colocated (world 2) or with vLLM on ranks of
its own (world 3 or 4: a split launch, megarl.rollout.remote.split_world, whose first 2 ranks train; the
rollout ranks serve the trainer's commands, megarl.rollout.remote.engine). Rank 0 saves each
step's metrics, responses and rewards, and the actor's final weights (HF names), to
``<tmp>/<mode>.pt``:

    torchrun --nproc_per_node 2|3|4 _disagg_worker.py SPEC.json MODE [MODE ...]

Several colocated modes run one after another in one launch of 2 ranks (each builds its run
afresh, its engine shut down after it: the launch's imports and start-up are paid once); a split
mode runs alone.

Modes: ``colocated`` and ``split`` (2 steps, staleness 0, the tiny MoE with R3, then one
multi-turn batch with R3: :func:`_multi_turn`); ``split_off``
(3 ReMax steps up to two steps off, as ``megarl train``'s loop asks at
``async_training.staleness_threshold=2``: step 1 asks for batches 2 and 3 as soon as its own is
in, step k > 1 for batch k+2; the 4th batch is one whose scorer raises, and step 4 records the
error the trainer raises) and its reference ``colocated_off``: colocated, but the sync after
step k loads the weights step k-1 started from (step 1: its own), so that batch k comes from the
weights after update max(0, k-3), as two steps off. ``split_one`` and ``colocated_one``: the
same 3 ReMax steps one step off (the rollout side loads each update straight into vLLM, no
staging), against a colocated engine one update behind (the sync after step k loads the weights
step k started from).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 2
STALENESS = {"split_off": 2, "colocated_off": 2, "split_one": 1, "colocated_one": 1}
"""How far the off-policy modes ask ahead (the colocated ones: how far their engine lags)."""


def _sync_with_older_weights(run, snapshots: list, lag: int) -> None:
    """Make this step's closing sync load the weights the actor had ``lag`` - 1 steps ago,
    before that step's update (the first step's when there were fewer)."""
    from megarl.rollout.base import update_weights
    from megarl.trainer import step as step_module
    from tests.trainer._update_worker import _hf_weights

    snapshots.append(_hf_weights(run.actor.chunks, run.actor.model.dims))
    old = snapshots[max(0, len(snapshots) - lag)]
    step_module.sync_engine = lambda run: update_weights(run.engine, old.items())


MT_RESPONSE_LENGTH = 200
"""The multi-turn batch's budget over all turns (the interaction's feedback is some 40 tokens;
the spec sets the engine's ``max_model_len`` to hold it)."""
STOPS = list(range(100, 200))
"""Token ids that end a model turn of the multi-turn batch (the random MoE samples one about
every tenth token), as in tests/trainer/_replay_worker.py."""


def _multi_turn(run, mt, pad: int) -> dict:
    """One multi-turn batch (issue 43) after the steps: the config's loop (verl's GSM8K
    interaction answering every model turn) at a larger budget, up to 3 model turns, ending
    them at ``STOPS`` too; with vLLM on ranks of its own the rollout ranks run it and the
    routing each trajectory composed there comes back with it. The actor's old log-probs
    replaying that routing, against vLLM's on the model tokens."""
    import dataclasses

    from megarl.trainer.passes import generate, recompute_log_probs
    from megarl.trainer.step import training_sampling

    cfg = run.cfg
    settings = dataclasses.replace(mt.settings, response_length=MT_RESPONSE_LENGTH,
                                   max_assistant_turns=3)  # fmt: skip
    loop = dataclasses.replace(mt, settings=settings,
                               stop_token_ids=[*mt.stop_token_ids, *STOPS])  # fmt: skip
    kwargs = {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "7"}}
    prompts = [dataclasses.replace(run.train_data[i], extra_info=kwargs) for i in next(run.sampler)]
    batch, _ = generate(
        run.engine, prompts, n=cfg.actor_rollout_ref.rollout.n,
        sampling={**training_sampling(run), "stop_token_ids": STOPS}, seed=cfg.trainer.seed,
        step=STEPS + 1, pad_token_id=pad, multi_turn=loop,
    )  # fmt: skip
    replayed = recompute_log_probs(run, batch)
    mask = batch.response_mask
    width = mask.shape[1]
    valid = torch.arange(width)[None] < (batch.lengths - batch.prompt_lengths)[:, None]
    return {
        **loop.last_metrics,
        "input_ids": batch.input_ids.tolist(),
        "response_mask": mask.tolist(),
        "rollout_log_probs": batch.rollout_log_probs,
        "old_log_probs": replayed.log_probs,
        "routing": batch.rollout_routing,
        "gap": float(((replayed.log_probs - batch.rollout_log_probs).abs() * mask).max()),
        "agreement": replayed.metrics["rollout_corr/router_agreement"],
        "user_tokens": float((valid & (mask == 0)).sum()),
        "model_tokens": float(mask.sum()),
    }


def _launch_size() -> int:
    import os

    return int(os.environ["WORLD_SIZE"])


def main() -> None:
    spec, modes = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2:]
    if len(modes) > 1 and any(m.startswith("split") for m in modes):
        raise SystemExit(f"a split mode runs alone in its launch: {modes}")
    from megarl.parallel.init import destroy_distributed
    from megarl.trainer import step as step_module

    sync_engine = step_module.sync_engine
    for mode in modes:
        try:
            trained = _run_mode(spec, mode, last=mode == modes[-1])
        finally:  # the colocated off-policy modes replace it (_sync_with_older_weights)
            step_module.sync_engine = sync_engine
    if trained:  # a split launch's rollout ranks leave once the trainer stopped them
        dist.barrier()
        destroy_distributed()


def _run_mode(spec: dict, mode: str, *, last: bool) -> bool:
    """One mode's run (see the module docstring); rank 0 saves ``<tmp>/<mode>.pt``. False on
    a rollout rank of a split launch."""
    from megarl.config import load_config
    from megarl.config.loader import resolve_config
    from megarl.trainer.console import Console

    lag = STALENESS.get(mode, 0)
    off = lag > 0  # the off-policy pairs: the dense model at PP 2; else the MoE
    config = spec["config"] if off else spec["on_config"]
    overrides = spec["overrides"] + (spec["off_overrides"] if off else spec["on_overrides"])
    if mode.endswith("_one"):
        overrides += spec["one_overrides"]
    if mode.startswith("split"):  # the config megarl train would split this launch by
        overrides += ["actor_rollout_ref.rollout.nnodes=1",
                      f"actor_rollout_ref.rollout.n_gpus_per_node={_launch_size() - 2}",
                      f"async_training.staleness_threshold={lag}"]  # fmt: skip
    cfg = resolve_config(load_config([config], overrides))
    if mode.startswith("split"):
        from megarl.rollout.remote.split_world import split_world

        world = split_world(2)
        if world.role == "rollout":
            from megarl.trainer.setup import serve_rollout

            serve_rollout(cfg)
            return False
    from megarl.trainer.setup import build_run
    from megarl.trainer.step import first_sync, train_step
    from tests.trainer._update_worker import _hf_weights

    run_dir = Path(spec["tmp"]) / mode
    out: dict = {"steps": []}
    with Console(run_dir / "logs", rank=dist.get_rank() if dist.is_initialized() else 0) as c:
        run = build_run(cfg, c, run_dir)
        try:
            # the on modes' config holds the multi-turn loop (with vLLM on ranks of its own the
            # rollout ranks build theirs from it); their training steps are single-turn
            mt, run.engine.multi_turn = getattr(run.engine, "multi_turn", None), None
            first_sync(run)
            steps = STEPS + 1 if off else STEPS
            draws = steps + lag
            batches = [[run.train_data[i] for i in next(run.sampler)] for _ in range(draws)]
            if mode == "split_off":  # the batch after the last: its scorer raises (see below)
                poison = [s.extra_info["index"] for s in batches[steps]]
                Path(spec["tmp"], "poison.json").write_text(json.dumps(poison))
            asked, snapshots = 1, []
            for step in range(1, steps + 1):
                if mode.startswith("colocated") and off:
                    _sync_with_older_weights(run, snapshots, lag)
                ahead = []
                while mode.startswith("split") and asked < step + lag:
                    asked += 1
                    ahead.append((asked, batches[asked - 1]))
                metrics, batch = train_step(run, step, batches[step - 1], ahead)
                out["steps"].append({
                    "metrics": metrics,
                    "responses": batch.responses.tolist() if hasattr(batch, "responses") else None,
                    "input_ids": batch.input_ids.tolist(),
                    "rewards": batch.token_level_rewards.sum(-1).tolist(),
                })  # fmt: skip
            if mt is not None:
                from megarl.trainer.batch import pad_token_id

                out["multi_turn"] = _multi_turn(run, mt, pad_token_id(run.tokenizer))
            out["weights"] = _hf_weights(run.actor.chunks, run.actor.model.dims)
            from megarl.planner.residency import residency

            out["residency"] = [(phase, applied, residency(cfg, phase))
                                for phase, applied in run.residency_log]  # fmt: skip
            out["world"] = dist.get_world_size()
            if mode == "split_off":
                # Batch 4, asked for by step 2, was scored on the rollout ranks while the steps
                # trained: its scorer's error reaches the trainer at step 4.
                from megarl.reward.manager import RewardError

                try:
                    train_step(run, steps + 1, batches[steps])
                except RewardError as exc:
                    out["scorer_error"] = str(exc)
        finally:
            run.rewards.close()
            if mode.startswith("split") or not last:  # another mode's engine comes next
                run.engine.shutdown()
    if dist.get_rank() == 0:
        torch.save(out, Path(spec["tmp"]) / f"{mode}.pt")
    return True


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
