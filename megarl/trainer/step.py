"""One training step, top to bottom, and one validation pass.

Step: global prompt batch → generate (rollout engine) → decode + score (rule scorers, or the
reward model: :mod:`megarl.trainer.reward_model`) → old log-probs, ref
log-probs (at the rollout temperature) → advantages over the global batch → actor update →
weight sync → metrics. Every rank runs the same code on the same global batch (SPMD).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from megarl.algo import compute_advantage, masked_mean
from megarl.data import PromptSample
from megarl.reward import RewardResult
from megarl.reward.manager import reward_inputs
from megarl.rollout.consistency import logprob_diff_metrics
from megarl.trainer.actor import update_policy
from megarl.trainer.batch import RolloutTensors, pad_token_id
from megarl.trainer.critic import global_values, update_critic, value_metrics
from megarl.trainer.passes import (
    actor_routing,
    correct_for_rollout,
    generate,
    old_log_probs_are_current,
    prefetch,
    recompute_log_probs,
    reference_log_probs,
)
from megarl.trainer.residency import enter, phase_peak_metrics
from megarl.trainer.setup import Run
from megarl.trainer.state import actor_trains


class Timer:
    """``timing_s/<phase>`` metrics."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


def train_step(
    run: Run,
    step: int,
    prompts: Sequence[PromptSample],
    ahead: Sequence[tuple[int, Sequence[PromptSample]]] = (),
) -> tuple[dict[str, float], RolloutTensors]:
    """Run training step ``step`` (1-based) on the global prompt batch ``prompts``; returns its
    metrics and the step's batch (tokens, rewards, log-probs, advantages: identical on every
    rank). ``ahead`` (an engine on other ranks only): ``(later step, its prompts)`` to ask for
    as soon as this step's batch is in, so that their generation overlaps training (with the
    weights this step starts from)."""
    cfg = run.cfg
    timer, start = Timer(), time.perf_counter()
    metrics: dict[str, float] = {}

    enter(run, "generate", step=step)
    with timer("gen"):
        batch, samples = generate(
            run.engine,
            prompts,
            n=cfg.actor_rollout_ref.rollout.n,
            sampling=training_sampling(run),
            seed=cfg.trainer.seed,
            step=step,
            pad_token_id=pad_token_id(run.tokenizer),
        )
    prescored = getattr(run.engine, "prescored", None)  # the rollout ranks scored it already
    if hasattr(run.engine, "last_version"):  # an engine on other ranks
        # weight updates between the batch's request and now (0 when no request was ahead); the
        # issue's (and verl's fully-async) mean and max over the samples: one version per batch
        staleness = float(run.engine.version - run.engine.last_version)
        metrics["async/staleness_mean"] = metrics["async/staleness_max"] = staleness
        metrics["async/wait_rollout_s"] = run.engine.waited_s
        metrics.update({f"async/rollout_{k}_s": v for k, v in run.engine.rollout_timing.items()})
    greedy = None
    if cfg.algorithm.adv_estimator == "remax":  # while the engine is awake (as verl)
        with timer("gen_baseline"):
            greedy = greedy_generation(run, prompts, step)
    for later, later_prompts in ahead:  # after this step's requests: the engine answers in order
        ask_ahead(run, later_prompts, later)

    enter(run, "reward", step=step)  # the engine asleep from here until the sync
    with timer("reward"):
        scored = _score(run, prompts, samples, batch, step, dump=cfg.trainer.rollout_data_dir,
                        prescored=prescored)  # fmt: skip
        batch.fields["token_level_rewards"] = scored.token_level_rewards

    # Old log-probs: recomputed by the actor (decoupled), or, with one mini-batch and one epoch
    # and nothing needing them earlier, taken from the update's own forward (verl's shortcut).
    shortcut = old_log_probs_are_current(run, len(batch))
    # Bypass mode takes the rollout's log-probs as the old ones, and verl 0.9.1 runs no
    # old-log-prob pass then; megarl runs it only for sum_v pi^2 (calculate_sum_pi_squared).
    bypass = cfg.algorithm.rollout_correction.bypass_mode
    sum_pi_squared = None
    if not shortcut and (not bypass or cfg.actor_rollout_ref.actor.calculate_sum_pi_squared):
        enter(run, "old_log_prob", step=step)
        with timer("old_log_prob"):
            sum_pi_squared, replay_metrics = recompute_log_probs(run, batch)
            metrics.update(replay_metrics)
    if run.ref is not None:
        enter(run, "ref", step=step)
        with timer("ref"):
            reference_log_probs(run, batch)
    metrics.update(correct_for_rollout(batch, cfg.algorithm.rollout_correction, shortcut))
    if run.critic is not None:
        enter(run, "values", step=step)
        with timer("values"):
            batch.fields["values"] = global_values(
                run.critic, batch, run.plan.values.micro_batch_size,  # type: ignore[union-attr]
                run.plan.values.max_token_len_per_gpu,  # type: ignore[union-attr]
            )  # fmt: skip
    if run.kl_ctrl is not None:  # KL in the reward, before the advantages
        metrics.update(penalize_kl(run, batch))
    baselines = None
    if greedy is not None:
        with timer("gen_baseline"):
            baselines = batch.fields["reward_baselines"] = greedy_baselines(
                run, prompts, *greedy, step
            )

    with timer("adv"):  # over the global batch: the same at every layout
        # The names megarl.config.algo_inputs lists (validation checked the estimator's needs).
        supplied = {
            "token_level_rewards": batch.fields["token_level_rewards"],
            "response_mask": batch.response_mask,
            "index": batch.prompt_ids,
            "gamma": cfg.algorithm.gamma,
            "lam": cfg.algorithm.lam,
            "norm_adv_by_std_in_grpo": cfg.algorithm.norm_adv_by_std_in_grpo,
            "rollout_is_weights": batch.fields.get("rollout_is_weights"),
        }
        when = {
            "old_log_prob": batch.fields.get("old_log_probs"),
            "sum_pi_squared": sum_pi_squared,
            "values": batch.fields.get("values"),
            "reward_baselines": baselines,
        }
        supplied.update({k: v for k, v in when.items() if v is not None})
        advantages, returns = compute_advantage(cfg.algorithm.adv_estimator, **supplied)
        batch.fields["advantages"], batch.fields["returns"] = advantages, returns

    if run.critic is not None:
        enter(run, "update_critic", step=step)
        with timer("update_critic"):
            metrics.update(update_critic(run.critic, batch, run.values, seed=cfg.trainer.seed,
                                         step=step))  # fmt: skip
        run.critic.advance_lr()
    if actor_trains(step, cfg.trainer.critic_warmup):
        enter(run, "update_actor", step=step)
        actor_routing(run, batch)  # R3: the rollout's routing, also without an old-log-prob pass
        with timer("update_actor"):
            metrics.update(
                update_policy(
                    run.actor,
                    batch,
                    run.policy,
                    vocab_size=run.vocab_size,
                    seed=cfg.trainer.seed,
                    step=step,
                    old_log_probs="current" if shortcut else "old_log_probs",
                )
            )
        run.actor.advance_lr()  # verl steps the LR schedule once per trainer step
    elif shortcut:  # no update ran: the recomputed log-probs still have to come from somewhere
        enter(run, "old_log_prob", step=step)
        metrics.update(recompute_log_probs(run, batch)[1])

    with timer("update_weights"):
        enter(run, "sync", step=step)  # vLLM's weights awake, its KV cache at the next generate
        if step not in cfg.trainer.skip_weight_sync_steps:
            sync_engine(run)
            if hasattr(run.engine, "sync_waited_s"):  # of it, waiting for the batch asked before
                metrics["async/sync_wait_rollout_s"] = run.engine.sync_waited_s
                metrics["async/update_weights_bytes"] = float(run.engine.update_bytes)

    metrics.update(step_metrics(run, batch, scored, timer, start))
    return metrics, batch


def validate(run: Run, step: int) -> dict[str, float]:
    """Generate for the whole validation set with ``rollout.val_kwargs``; mean score per
    ``data_source`` (``val-core/<source>/reward/mean@<n>``) and over all (``val/score/mean``)."""
    cfg = run.cfg
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    prompts = [run.val_data[i] for i in range(len(run.val_data))]  # type: ignore[arg-type]
    enter(run, "generate", step=step)
    sampling = {
        "temperature": val.temperature if val.do_sample else 0.0,
        "top_p": val.top_p if val.do_sample else 1.0,
        "top_k": val.top_k if val.do_sample else -1,
        "max_tokens": cfg.actor_rollout_ref.rollout.response_length,
    }
    batch, samples = generate(
        run.engine,
        prompts,
        n=val.n,
        sampling=sampling,
        seed=cfg.trainer.seed,
        step=-1,  # validation draws are the same at every validation
        pad_token_id=pad_token_id(run.tokenizer),
    )
    scored = _score(run, prompts, samples, batch, step, dump=cfg.trainer.validation_data_dir)
    sources = [prompts[s.prompt_index].data_source for s in samples]
    metrics = {"val/score/mean": float(scored.scores.mean())}
    for source in sorted(set(sources)):
        rows = torch.tensor([s == source for s in sources])
        metrics[f"val-core/{source}/reward/mean@{val.n}"] = float(scored.scores[rows].mean())
    return metrics


def training_sampling(run: Run) -> dict[str, float | int]:
    roll = run.cfg.actor_rollout_ref.rollout
    return {
        "temperature": roll.temperature if roll.do_sample else 0.0,
        "top_p": roll.top_p,
        "top_k": roll.top_k,
        "max_tokens": roll.response_length,
    }


def penalize_kl(run: Run, batch: RolloutTensors) -> dict[str, float]:
    """``algorithm.use_kl_in_reward``: token rewards minus β·KL(π_old ‖ π_ref) (the rollout's
    log-probs in bypass mode), then the controller's update from the global mean KL with
    n_steps = the batch's responses, as verl."""
    from megarl.algo import apply_kl_penalty

    coef = run.kl_ctrl.value
    rewards, current_kl = apply_kl_penalty(
        batch.fields["token_level_rewards"],
        batch.fields["old_log_probs"],
        batch.fields["ref_log_probs"],
        batch.response_mask,
        kl_coef=coef,
        kl_penalty=run.cfg.algorithm.kl_penalty,
    )
    batch.fields["token_level_scores"] = batch.fields["token_level_rewards"]
    batch.fields["token_level_rewards"] = rewards
    run.kl_ctrl.update(float(current_kl), n_steps=len(batch))
    return {"actor/reward_kl_penalty": float(current_kl), "actor/reward_kl_penalty_coeff": coef}


def ask_ahead(run: Run, prompts: Sequence[PromptSample], step: int) -> None:
    """Ask the engine on other ranks for step ``step``'s batch (and ReMax's greedy one, from
    the same weights) now, to be generated while this step trains; the rollout ranks score it
    too, unless the run's reward model (on the training ranks) does."""
    cfg = run.cfg
    reward = None
    if run.reward_model is None:
        reward = {"prompts": [(p.data_source, p.ground_truth, p.extra_info) for p in prompts],
                  "dump_dir": cfg.trainer.rollout_data_dir, "step": step}  # fmt: skip
    requests = [(cfg.actor_rollout_ref.rollout.n, training_sampling(run), reward)]
    if cfg.algorithm.adv_estimator == "remax":
        requests.append((1, greedy_sampling(run), None))
    prefetch(run.engine, prompts, requests, seed=cfg.trainer.seed, step=step)


def greedy_generation(run: Run, prompts: Sequence[PromptSample], step: int):
    """ReMax: one greedy response per prompt (generated with the step's batch, while the engine
    is awake); scored by :func:`greedy_baselines`."""
    return generate(
        run.engine,
        prompts,
        n=1,
        sampling=greedy_sampling(run),
        seed=run.cfg.trainer.seed,
        step=step,
        pad_token_id=pad_token_id(run.tokenizer),
    )


def greedy_sampling(run: Run) -> dict[str, float | int]:
    """ReMax's greedy decoding of the training prompts (verl: ``do_sample=False``)."""
    return {**training_sampling(run), "temperature": 0.0, "top_p": 1.0, "top_k": -1}


def greedy_baselines(
    run: Run, prompts: Sequence[PromptSample], greedy: RolloutTensors, samples, step: int
) -> torch.Tensor:
    """ReMax: each response's baseline is its prompt's greedy score (``reward_baselines [B]``)."""
    scored = _score(run, prompts, samples, greedy, step, dump=None)
    return scored.scores.repeat_interleave(run.cfg.actor_rollout_ref.rollout.n)


def first_sync(run: Run) -> None:
    """Before anything generates: the engine slept (level 2) since its start; give it the actor's
    weights (the initial ones, or a resumed checkpoint's)."""
    enter(run, "sync")
    sync_engine(run)


def sync_engine(run: Run) -> None:
    """Push the actor's weights into the rollout engine (nothing to do when it is the actor)."""
    if run.reshard_plan is None:
        return
    from megarl.rollout.reshard import sync_weights

    sync_weights(run.actor.chunks, run.reshard_plan, run.engine)


def _score(
    run, prompts, samples, batch: RolloutTensors, step: int, dump, prescored=None
) -> RewardResult:
    """The batch's rewards: ``prescored`` when the rollout ranks scored it (a
    ``RewardResult``, or their scorer's one-line error), else the run's reward manager's."""
    if prescored is not None:
        if isinstance(prescored, str):
            from megarl.reward.manager import RewardError

            raise RewardError(prescored)
        _check_timeouts(run, prescored, step)
        return prescored
    inputs = reward_inputs(run.tokenizer, prompts, samples)
    model_scores = None  # a reward model replaces the rule scorers (verl 0.9.1)
    if run.reward_model is not None:
        model_scores = run.reward_model.score(
            [prompts[s.prompt_index].raw_prompt for s in samples],
            [s.response_token_ids for s in samples],
        )
    scored = run.rewards(
        inputs,
        response_width=batch.response_mask.shape[1],
        dump_dir=dump,
        step=step,
        model_scores=model_scores,
    )
    _check_timeouts(run, scored, step)
    return scored


TIMEOUT_WARNING_SHARE = 0.5
"""A step whose share of timed-out scorings exceeds this warns on the console."""
ALLOW_ALL_TIMEOUTS_ENV = "MEGARL_ALLOW_ALL_REWARD_TIMEOUTS"


def _check_timeouts(run, scored: RewardResult, step: int) -> None:
    """Timeouts score 0: say so on the console when they are many, and stop the run when
    every sample timed out (training on all-zero rewards), unless ``$MEGARL_ALLOW_ALL_REWARD_
    TIMEOUTS=1``. Every rank sees the same outcomes, so every rank decides alike."""
    n, timed_out = scored.timed_out.numel(), int(scored.timed_out.sum())
    if n == 0 or timed_out <= TIMEOUT_WARNING_SHARE * n:
        return
    limit = run.cfg.reward_model.compute_score_timeout
    what = f"step {step}: {timed_out} of {n} samples' scoring timed out ("
    what += f"reward_model.compute_score_timeout={limit:g} s) and scored 0"
    if timed_out == n and os.environ.get(ALLOW_ALL_TIMEOUTS_ENV, "0") in ("", "0"):
        from megarl.reward.manager import RewardError

        raise RewardError(
            f"{what}: stopping rather than training on nothing (raise the limit, fix the "
            f"scorer, or set {ALLOW_ALL_TIMEOUTS_ENV}=1 to train on)"
        )
    run.console.print(f"megarl: warning: {what}")


def _stats(name: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    v = values.float()
    return {
        f"{name}/mean": float(v.mean()),
        f"{name}/max": float(v.max()),
        f"{name}/min": float(v.min()),
    }


def batch_metrics(batch: RolloutTensors, scored: RewardResult, max_response: int) -> dict:
    """verl's data metrics: scores, rewards, advantages, returns, lengths."""
    mask = batch.response_mask.bool()
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", scored.scores))
    metrics.update(_stats("critic/rewards", batch.fields["token_level_rewards"].sum(-1)))
    metrics.update(_stats("critic/advantages", batch.fields["advantages"][mask]))
    metrics.update(_stats("critic/returns", batch.fields["returns"][mask]))
    response = batch.response_lengths
    metrics.update(_stats("response_length", response))
    metrics["response_length/clip_ratio"] = float((response >= max_response).float().mean())
    metrics.update(_stats("prompt_length", batch.prompt_lengths))
    return metrics


def step_metrics(
    run: Run, batch: RolloutTensors, scored: RewardResult, timer: Timer, start: float
) -> dict[str, float]:
    """Rewards, data, consistency, timing and throughput metrics of a finished step."""
    metrics = dict(scored.metrics)
    metrics.update(batch_metrics(batch, scored, run.cfg.data.max_response_length))
    if "values" in batch.fields:
        metrics.update(value_metrics(batch))
    if "recomputed_log_probs" in batch.fields:  # bypass mode computes no actor log-probs
        metrics.update(rollout_consistency(batch, batch.fields["recomputed_log_probs"]))
    metrics.update(timer.metrics())
    metrics.update(phase_peak_metrics(run))
    metrics["timing_s/step"] = time.perf_counter() - start
    tokens = float(batch.lengths.sum())
    metrics["perf/total_num_tokens"] = tokens
    metrics["perf/throughput"] = tokens / metrics["timing_s/step"] / run.world_size
    return metrics


def rollout_consistency(batch: RolloutTensors, recomputed: torch.Tensor) -> dict[str, float]:
    """The rollout engine's log-probs vs the actor's on the rollout's own tokens: the proof that
    the last weight sync worked (and NeMo-RL's token probability ratio error)."""
    mask = batch.response_mask.bool()
    out = {
        f"rollout/{k.split('/')[-1]}": v
        for k, v in logprob_diff_metrics(batch.rollout_log_probs, recomputed, mask).items()
    }
    diff = (batch.rollout_log_probs - recomputed).abs()
    out["rollout/token_mult_prob_error"] = (
        float(masked_mean(torch.exp(diff), mask)) if mask.any() else 1.0
    )
    return out
