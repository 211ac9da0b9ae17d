"""Routing replay R3 inside the trainer (2 ranks, ``configs/grpo_moe_tiny_cpu.yaml``: actor
EP 2, vLLM TP 2 capturing the rollout's routing): ``torchrun ... _replay_worker.py SPEC.json``.

On one rollout, the actor's old log-probs against vLLM's, with and without replay, first with
the synced weights, then with the actor's routers perturbed so that some tokens route
differently; then one whole training step (KL loss on: the reference routes afresh); then the
same two measurements on multi-turn rollouts (model turns and interaction turns). Rank 0 saves
what it measured to ``<tmp>/replay.pt``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _largest_gap(log_probs: torch.Tensor, batch) -> float:
    return float(((log_probs - batch.rollout_log_probs).abs() * batch.response_mask).max())


def _perturbed_routers(chunks, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Add seeded noise (the same on every rank) to every router's weight; the originals."""
    from megarl.models.routing import routers

    saved, gen = [], torch.Generator().manual_seed(11)
    for chunk in chunks:
        for router in routers(chunk):
            w = router.weight.data
            saved.append((w, w.clone()))
            noise = torch.randn(w.shape, generator=gen, dtype=torch.float32)
            w.add_(scale * float(w.std()) * noise.to(w))
    return saved


def _expected_load(batch, experts: int) -> dict[str, float]:
    """The update's expert load as it should be, from the rollout's routing the update
    replayed: every real position's top-k, counted per layer and expert, leaving out the
    positions nothing was routed at (-1: each sequence's last token, replayed onto experts
    0..k-1 only to go somewhere), summarised as max / mean per layer."""
    captured = batch.rollout_routing.long()  # [rows, positions, layers, k]
    _, width, layers, _ = captured.shape
    real = torch.arange(width)[None, :] < batch.lengths[:, None]
    ratios = []
    for layer in range(layers):
        choice = captured[:, :, layer][real]  # [tokens, k]
        choice = choice[choice[:, 0] >= 0]
        counts = torch.bincount(choice.reshape(-1), minlength=experts).double()
        ratios.append(float(counts.max() / counts.mean()))
    return {"mean": sum(ratios) / layers, "max": max(ratios), "layer": ratios.index(max(ratios))}


MT_RESPONSE_LENGTH = 200
"""The multi-turn case's budget over all turns (the interaction's feedback is some 40 tokens);
the spec sets the engine's ``max_model_len`` to hold it."""
STOPS = list(range(100, 200))
"""Token ids that end a model turn of the multi-turn case: the random model samples one about
every tenth token, so each trajectory has several short turns."""


def _multi_turn_batch(run, cfg, generate, pad: int):
    """Multi-turn rollouts (issue 43) of the random MoE: each model turn ends at one of
    ``STOPS``, verl's GSM8K interaction answers it (a user turn, response_mask 0), up to 3 model
    turns; the loop composes each trajectory's routing from its turns' requests."""
    import dataclasses

    from megarl.rollout.multi_turn import MultiTurnSettings
    from megarl.rollout.multi_turn_rollout import MultiTurnRollout
    from megarl.tools.interactions.gsm8k_interaction import Gsm8kInteraction
    from megarl.trainer.step import training_sampling

    kwargs = {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "7"}}
    prompts = [dataclasses.replace(run.train_data[i], extra_info=kwargs) for i in next(run.sampler)]
    settings = MultiTurnSettings(
        response_length=MT_RESPONSE_LENGTH, max_assistant_turns=3,
        max_model_len=cfg.actor_rollout_ref.rollout.max_model_len,
    )  # fmt: skip
    rollout = MultiTurnRollout(
        run.tokenizer, {}, {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})}, settings,
        [*run.engine.eos_token_ids, *STOPS],
    )  # fmt: skip
    batch, _ = generate(
        run.engine, prompts, n=cfg.actor_rollout_ref.rollout.n,
        sampling={**training_sampling(run), "stop_token_ids": STOPS}, seed=cfg.trainer.seed,
        step=2, pad_token_id=pad, multi_turn=rollout,
    )  # fmt: skip
    width = batch.response_mask.shape[1]
    valid = torch.arange(width)[None] < (batch.lengths - batch.prompt_lengths)[:, None]
    return batch, {
        **rollout.last_metrics,
        "user_tokens": float((valid & (batch.response_mask == 0)).sum()),
        "model_tokens": float(batch.response_mask.sum()),
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from megarl.config import load_config
    from megarl.models.tiny import MOE_DEFAULTS
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.trainer.batch import pad_token_id
    from megarl.trainer.console import Console
    from megarl.trainer.passes import generate, global_log_probs, recompute_log_probs
    from megarl.trainer.setup import build_run
    from megarl.trainer.step import first_sync, train_step, training_sampling

    init_distributed(seed=1)
    cfg = load_config([spec["config"]], spec["overrides"])
    run_dir = Path(spec["tmp"]) / "run"
    out: dict = {}
    with Console(run_dir / "logs", rank=dist.get_rank()) as console:
        run = build_run(cfg, console, run_dir)
        try:
            first_sync(run)
            prompts = [run.train_data[i] for i in next(run.sampler)]
            batch, _ = generate(
                run.engine, prompts, n=cfg.actor_rollout_ref.rollout.n,
                sampling=training_sampling(run), seed=cfg.trainer.seed, step=1,
                pad_token_id=pad_token_id(run.tokenizer),
            )  # fmt: skip

            def measure(tag: str, batch=batch) -> None:
                free, _, _ = global_log_probs(
                    run.actor.chunks, batch, vocab_size=run.vocab_size,
                    temperature=cfg.actor_rollout_ref.rollout.temperature, micro_batches=None,
                )  # fmt: skip
                replayed = recompute_log_probs(run, batch)
                out[tag] = {
                    "free": _largest_gap(free, batch),
                    "replayed": _largest_gap(replayed.log_probs, batch),
                    "agreement": replayed.metrics["rollout_corr/router_agreement"],
                }

            measure("synced")
            saved = _perturbed_routers(run.actor.chunks, spec["scale"])
            measure("perturbed")
            for w, original in saved:
                w.copy_(original)
            out["step"], step_batch = train_step(
                run, 1, [run.train_data[i] for i in next(run.sampler)]
            )
            out["expected_load"] = _expected_load(step_batch, MOE_DEFAULTS["num_experts"])
            # multi-turn with R3, after the step's sync: replayed, then with perturbed routers
            mt_batch, out["mt_rollout"] = _multi_turn_batch(
                run, cfg, generate, pad_token_id(run.tokenizer)
            )
            measure("mt_synced", mt_batch)
            saved = _perturbed_routers(run.actor.chunks, spec["scale"])
            measure("mt_perturbed", mt_batch)
            for w, original in saved:
                w.copy_(original)
        finally:
            run.rewards.close()
    if dist.get_rank() == 0:
        torch.save(out, Path(spec["tmp"]) / "replay.pt")
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
