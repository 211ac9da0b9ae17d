"""Several short training runs in one torchrun launch (importing Megatron costs ~10 s a process).

Each run builds the trainer's ``Run`` from a config with overrides and calls ``train_step`` for
a few steps, recording per step the metrics, the advantages and the responses, and at the end
whether the DP replicas hold bit-identical weights. A run with its own ``config`` is a learning
run: greedy validation before and after, metrics per step. Rank 0 saves everything for pytest:
``python -m torch.distributed.run --nproc_per_node W _runs_worker.py SPEC.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

KEPT = (
    "advantages", "returns", "values", "token_level_scores", "token_level_rewards",
    "old_log_probs", "ref_log_probs", "reward_baselines",
)  # fmt: skip
POISON = {"step": None}
"""Set to a step number: rank 1's loss becomes NaN in that step (the NaN-injection check)."""


def _poisoned_forward_backward(original):
    def forward_backward(chunks, batch, loss_fn, **kwargs):
        step = POISON["step"]

        def poisoned(outputs, mb):
            loss, metrics = loss_fn(outputs, mb)
            return loss * float("nan"), metrics

        if step is not None and dist.get_rank() == 1:
            return original(chunks, batch, poisoned, **kwargs)
        return original(chunks, batch, loss_fn, **kwargs)

    return forward_backward


def _weights_checksums(chunks) -> torch.Tensor:
    from megarl.models.weights import local_global_names

    return torch.tensor(
        [float(p.detach().double().sum()) for *_, p in local_global_names(chunks)],
        dtype=torch.float64,
    )


def _replicas_identical(chunks) -> bool:
    from megatron.core import parallel_state

    from megarl.parallel.collectives import all_gather_tensors

    sums = _weights_checksums(chunks)
    group = parallel_state.get_data_parallel_group()
    parts = all_gather_tensors(sums, group)
    return all(torch.equal(parts[0], p) for p in parts)


def _greedy_scores(run, prompts) -> torch.Tensor:
    """Each prompt's greedy response scored here directly: the engine at temperature 0, the
    configured scorer function (a user file in the test) on the decoded text."""
    from megarl.reward.loader import ScorerSpec, load_scorer

    compute_score = load_scorer(ScorerSpec.from_config(run.cfg.custom_reward_function))

    out = run.engine.generate(
        [list(p.prompt_ids) for p in prompts],
        n=1,
        temperature=0.0,
        max_tokens=run.cfg.actor_rollout_ref.rollout.response_length,
        seed=0,
    )
    scores = []
    for sample, prompt in zip(out, prompts, strict=True):
        text = run.tokenizer.decode(sample.response_token_ids, skip_special_tokens=True)
        result = compute_score(prompt.data_source, text, prompt.ground_truth)
        scores.append(float(result["score"] if isinstance(result, dict) else result))
    return torch.tensor(scores)


def _one_run(spec: dict, run_spec: dict) -> dict:
    from megarl.config import load_config
    from megarl.trainer.console import Console
    from megarl.trainer.setup import build_run
    from megarl.trainer.step import first_sync, train_step

    run_dir = Path(spec["tmp"]) / f"{run_spec['name']}_ws{dist.get_world_size()}"
    overrides = [*spec["overrides"], *run_spec["overrides"], f"trainer.default_local_dir={run_dir}"]
    cfg = load_config([spec["config"]], overrides)
    steps = []
    with Console(run_dir / "logs", rank=dist.get_rank()) as console:
        run = build_run(cfg, console, run_dir)
        try:
            first_sync(run)
            for step in range(1, run_spec["steps"] + 1):
                POISON["step"] = step if step == run_spec.get("poison_step") else None
                before = _weights_checksums(run.actor.chunks)
                prompts = [run.train_data[i] for i in next(run.sampler)]
                greedy = _greedy_scores(run, prompts) if run_spec.get("greedy_scores") else None
                metrics, batch = train_step(run, step, prompts)
                record = {
                    "metrics": metrics,
                    "input_ids": batch.input_ids,
                    "mask": batch.response_mask,
                    "rollout_log_probs": batch.rollout_log_probs,
                    "greedy_scores": greedy,
                    "prompt_lengths": batch.prompt_lengths,
                    "raw_prompts": [p.raw_prompt for p in prompts],
                    "weights_unchanged": torch.equal(before, _weights_checksums(run.actor.chunks)),
                }
                record.update({k: getattr(batch, k) for k in KEPT if getattr(batch, k) is not None})
                steps.append(record)
            identical = _replicas_identical(run.actor.chunks)
        finally:
            POISON["step"] = None
            run.rewards.close()
    return {"steps": steps, "replicas_identical": identical, "residency": run.residency_log}


def _learning_run(spec: dict, run_spec: dict) -> dict:
    """A run of ``run_spec["config"]`` with greedy validation before the first and after the last
    step; per step only the metrics are kept."""
    from megarl.config import load_config
    from megarl.trainer.console import Console
    from megarl.trainer.setup import build_run
    from megarl.trainer.step import first_sync, train_step, validate

    run_dir = Path(spec["tmp"]) / f"{run_spec['name']}_ws{dist.get_world_size()}"
    overrides = [*spec["overrides"], *run_spec["overrides"], f"trainer.default_local_dir={run_dir}"]
    cfg = load_config([run_spec["config"]], overrides)
    with Console(run_dir / "logs", rank=dist.get_rank()) as console:
        run = build_run(cfg, console, run_dir)
        try:
            first_sync(run)
            first = validate(run, 0)["val/score/mean"]
            steps = []
            for step in range(1, run_spec["steps"] + 1):
                metrics, _ = train_step(run, step, [run.train_data[i] for i in next(run.sampler)])
                steps.append({"metrics": metrics})
            last = validate(run, run_spec["steps"])["val/score/mean"]
        finally:
            run.rewards.close()
    return {"steps": steps, "val_before": first, "val_after": last}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from megarl.trainer import update

    update.forward_backward = _poisoned_forward_backward(update.forward_backward)
    from megarl.parallel.init import destroy_distributed, init_distributed

    init_distributed(seed=1)
    world = dist.get_world_size()
    results = {}
    for run_spec in spec["runs"]:
        if world in run_spec["worlds"]:
            one = _learning_run if "config" in run_spec else _one_run
            results[run_spec["name"]] = one(spec, run_spec)
    if dist.get_rank() == 0:
        torch.save(results, Path(spec["tmp"]) / f"runs_ws{world}.pt")
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
