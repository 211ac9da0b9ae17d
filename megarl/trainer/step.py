"""One training step, top to bottom (:func:`train_step`), and one validation pass.

Every rank runs the same code on the same global batch (SPMD). Each phase returns its tensors
and only :func:`train_step` puts them into the :class:`~megarl.trainer.batch.StepBatch`, so the
function reads as the step's data flow.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from megarl.algo import compute_advantage
from megarl.config.async_schedule import syncs_after
from megarl.data import PromptSample
from megarl.reward import RewardResult
from megarl.reward.manager import RewardError, result_rows
from megarl.trainer import teacher
from megarl.trainer.batch import StepBatch, batch_from_samples, pad_token_id
from megarl.trainer.metrics import Timer, step_metrics
from megarl.trainer.passes import (
    actor_replay_routing,
    captured_routing,
    correct_for_rollout,
    critic_values,
    generate,
    old_log_probs_are_current,
    prefetch,
    prompt_images,
    recompute_log_probs,
    reference_log_probs,
)
from megarl.trainer.residency import enter
from megarl.trainer.scoring import score
from megarl.trainer.setup import Run
from megarl.trainer.state import actor_trains
from megarl.trainer.update import update_critic, update_policy


def train_step(
    run: Run,
    step: int,
    prompts: Sequence[PromptSample],
    ahead: Sequence[tuple[int, Sequence[PromptSample]]] = (),
    more: Callable[[], tuple[Sequence[PromptSample], int | None]] | None = None,
    label: int | None = None,
) -> tuple[dict[str, float], StepBatch]:
    """Run training step ``step`` (1-based) on the global prompt batch ``prompts``; returns its
    metrics and the step's batch (identical on every rank). ``ahead`` (an engine on ranks of its
    own only): ``(later step, its prompts)`` to ask for as soon as this step's batch is in, so
    that their generation overlaps training (with the weights this step starts from). ``more``
    (DAPO's dynamic sampling): the next generation batch's prompts, drawn when the groups kept
    so far do not fill ``data.train_batch_size``, and the label it was asked ahead under (None:
    not asked). ``label``: the number this batch was asked ahead under (default ``step``);
    with dynamic sampling on an engine of its own, generation batches, not steps, are numbered
    (:func:`fill_with_groups`)."""
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
            step=step if label is None else label,
            pad_token_id=pad_token_id(run.tokenizer),
            image_width=run.image_width,
        )
    metrics.update(samples.metrics)  # multi-turn: turns, tool calls and their outcomes
    if run.ahead is not None:
        metrics.update(staleness_metrics(run, samples))
    greedy = None
    if cfg.algorithm.adv_estimator == "remax":  # while the engine is awake (as verl)
        with timer("gen_baseline"):
            greedy = greedy_generation(run, prompts, step)
    for later, later_prompts in ahead:  # after this step's requests: the engine answers in order
        ask_ahead(run, later_prompts, later)

    enter(run, "reward", step=step)  # the engine asleep from here until the sync
    with timer("reward"):
        prescored = run.ahead.prescored if run.ahead is not None else None
        scored = score(run, prompts, samples, batch, step, dump=cfg.trainer.rollout_data_dir,
                       prescored=prescored)  # fmt: skip
    if cfg.algorithm.filter_groups.enable:
        assert more is not None, "dynamic sampling draws its generation batches with more()"
        batch, samples, prompts, scored, kept = fill_with_groups(
            run, step, prompts, batch, samples, scored, more, timer
        )
        metrics.update(kept)
    batch.token_level_scores = batch.token_level_rewards = scored.token_level_rewards

    # Old log-probs: recomputed by the actor (decoupled), or, with one mini-batch and one epoch
    # and nothing needing them earlier, taken from the update's own forward (verl's shortcut).
    # Bypass mode takes the rollout's log-probs as the old ones, and verl 0.9.1 runs no
    # old-log-prob pass then; megarl runs it only for sum_v pi^2 (calculate_sum_pi_squared).
    shortcut = old_log_probs_are_current(run, len(batch))
    bypass = cfg.algorithm.rollout_correction.bypass_mode
    batch.routing = actor_replay_routing(run, batch)  # R3: the rollout's; R2: recorded below
    if not shortcut and (not bypass or cfg.actor_rollout_ref.actor.calculate_sum_pi_squared):
        enter(run, "old_log_prob", step=step)
        with timer("old_log_prob"):
            actor_pass = recompute_log_probs(run, batch)
        batch.recomputed_log_probs, batch.routing = actor_pass.log_probs, actor_pass.routing
        batch.sum_pi_squared = actor_pass.sum_pi_squared
        metrics.update(actor_pass.metrics)
    if run.ref is not None:
        enter(run, "ref", step=step)
        with timer("ref"):
            batch.ref_log_probs = reference_log_probs(run, batch)
    if teacher.present(run):
        if run.teacher is not None:  # the Megatron teacher's parameters onto the device
            enter(run, "teacher", step=step)
        with timer("teacher"):
            routed = [prompts[s.prompt_index] for s in samples]
            metrics.update(teacher.score_batch(run, batch, routed))
    correction = correct_for_rollout(batch, cfg.algorithm.rollout_correction, shortcut)
    batch.old_log_probs = correction.old_log_probs
    batch.rollout_is_weights = correction.rollout_is_weights
    metrics.update(correction.metrics)
    if run.critic is not None:
        enter(run, "values", step=step)
        with timer("values"):
            plan = run.plan.values
            batch.values = critic_values(run.critic, batch, micro_batches=plan.micro_batch_size,
                                         max_token_len=plan.max_token_len_per_gpu)  # fmt: skip
    if run.kl_ctrl is not None:  # KL in the reward, before the advantages
        batch.token_level_rewards, kl_metrics = penalize_kl(run, batch)
        metrics.update(kl_metrics)
    if greedy is not None:
        with timer("gen_baseline"):
            batch.reward_baselines = greedy_baselines(run, prompts, *greedy, step)

    with timer("adv"):  # over the global batch: the same at every layout
        batch.advantages, batch.returns = advantages(run, batch, scored)
    if cfg.algorithm.adv_estimator == "gdpo":
        metrics.update(gdpo_metrics(cfg.algorithm.gdpo_reward_keys, scored))

    if run.critic is not None:
        enter(run, "update_critic", step=step)
        with timer("update_critic"):
            metrics.update(update_critic(run.critic, batch, run.values, seed=cfg.trainer.seed,
                                         step=step))  # fmt: skip
        run.critic.advance_lr()
    if actor_trains(step, cfg.trainer.critic_warmup):
        enter(run, "update_actor", step=step)
        with timer("update_actor"):
            update = update_policy(
                run.actor,
                batch,
                run.policy,
                vocab_size=run.vocab_size,
                seed=cfg.trainer.seed,
                step=step,
                old_are_current=shortcut,
            )
        metrics.update(update.metrics)
        if update.current_log_probs is not None:
            batch.recomputed_log_probs = update.current_log_probs
        run.actor.advance_lr()  # verl steps the LR schedule once per trainer step
    elif shortcut:  # no update ran: the recomputed log-probs still have to come from somewhere
        enter(run, "old_log_prob", step=step)
        actor_pass = recompute_log_probs(run, batch)
        batch.recomputed_log_probs = actor_pass.log_probs
        metrics.update(actor_pass.metrics)

    with timer("update_weights"):
        enter(run, "sync", step=step)  # vLLM's weights awake, its KV cache at the next generate
        if step not in cfg.trainer.skip_weight_sync_steps and syncs_after(
            cfg, step, run.total_steps
        ):
            synced = sync_engine(run)
            if run.ahead is not None:  # the weights after this step are that version
                run.ahead.version_steps[run.ahead.version] = step
            if synced is not None:  # bytes handed to vLLM per rank (LoRA merge=false: adapters)
                metrics["sync/bytes"] = float(synced.bytes)
            if run.ahead is not None:  # of it, waiting for the batch asked before
                metrics["async/sync_wait_rollout_s"] = run.ahead.sync_waited_s
                metrics["async/update_weights_bytes"] = float(run.ahead.update_bytes)

    if run.ahead is not None and batch.recomputed_log_probs is not None:
        metrics.update(current_version_agreement(run, samples, batch, step))
    metrics.update(step_metrics(run, batch, scored, timer, start))
    return metrics, batch


def current_version_agreement(run: Run, samples, batch: StepBatch, step: int) -> dict[str, float]:
    """Partial rollouts: the rollout's log-probs against the actor's on the tokens that the
    weights the actor held at this step's start sampled (a version synced right after step
    ``step - 1``): the proof that every sync reached vLLM, where the batch mixes versions."""
    engine = run.ahead
    current = [v for v, at in engine.version_steps.items() if at == step - 1]
    if not current or not any(s.token_versions for s in samples):
        return {}
    from megarl.rollout.consistency import logprob_diff_metrics

    width = batch.rollout_log_probs.shape[1]
    versions = torch.full((len(samples), width), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        if s.token_versions:
            versions[i, : len(s.token_versions)] = torch.tensor(s.token_versions)
    mask = batch.response_mask.bool() & (versions == current[0])
    diff = logprob_diff_metrics(batch.rollout_log_probs, batch.recomputed_log_probs, mask)
    return {"async/current_version_logprob_diff_max": diff["rollout/logprob_diff_max"],
            "async/current_version_tokens": float(mask.sum())}  # fmt: skip


def advantages(
    run: Run, batch: StepBatch, scored: RewardResult | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of ``algorithm.adv_estimator`` over the global batch, from the
    inputs it declares (:mod:`megarl.config.algo_inputs`; validation checked it gets them);
    gdpo's reward components are the fields of ``scored`` (the scorer's returned dicts)."""
    cfg = run.cfg
    supplied = {
        "token_level_rewards": batch.token_level_rewards,
        "response_mask": batch.response_mask,
        "index": batch.prompt_ids,
        "gamma": cfg.algorithm.gamma,
        "lam": cfg.algorithm.lam,
        "norm_adv_by_std_in_grpo": cfg.algorithm.norm_adv_by_std_in_grpo,
        "rollout_is_weights": batch.rollout_is_weights,
    }
    when = {
        "old_log_prob": batch.old_log_probs,
        "sum_pi_squared": batch.sum_pi_squared,
        "values": batch.values,
        "reward_baselines": batch.reward_baselines,
    }
    supplied.update({k: v for k, v in when.items() if v is not None})
    if cfg.algorithm.adv_estimator == "gdpo":
        keys = cfg.algorithm.gdpo_reward_keys
        supplied.update(reward_components=gdpo_components(keys, scored), gdpo_reward_keys=keys,
                        gdpo_reward_weights=cfg.algorithm.gdpo_reward_weights)  # fmt: skip
    return compute_advantage(cfg.algorithm.adv_estimator, **supplied)


def gdpo_components(keys: Sequence[str], scored: RewardResult | None) -> dict[str, torch.Tensor]:
    """GDPO's reward components ``{key: [B]}``: the numeric fields of the reward function's
    returned dicts (verl: its non_tensor_batch); a key the function does not return is one line."""
    fields = scored.fields if scored is not None else {}
    missing = [k for k in keys if k not in fields]
    if missing:
        have = ", ".join(sorted(fields)) or "none: it returns a plain score"
        raise RewardError(
            f"algorithm.gdpo_reward_keys {missing}: not among the numeric fields the reward "
            f"function returns ({have}); return a dict with a number under each key"
        )
    return {k: fields[k] for k in keys}


def gdpo_metrics(keys: Sequence[str], scored: RewardResult) -> dict[str, float]:
    """verl's ``gdpo/<key>/{mean,std,max,min}`` (population std) of each component."""
    out = {}
    for key in keys:
        v = scored.fields[key].double()
        out.update({f"gdpo/{key}/mean": float(v.mean()), f"gdpo/{key}/std": float(v.std(correction=0)),
                    f"gdpo/{key}/max": float(v.max()), f"gdpo/{key}/min": float(v.min())})  # fmt: skip
    return out


def filter_metric(metric: str, scored: RewardResult) -> torch.Tensor:
    """Each response's value of ``algorithm.filter_groups.metric`` ``[B]``, as verl-recipe's
    DAPO trainer reads it: seq_reward and seq_final_reward are the reward (the score after the
    dapo manager's overlong penalty; no KL in the reward with dynamic sampling); any other name
    is what the manager recorded before that penalty: score the function's own score, acc the
    scorer's ``acc`` field (a plain score, as verl's managers record it), anything else a
    numeric field of the scorer's dict."""
    if metric in ("seq_reward", "seq_final_reward"):
        return scored.scores
    if metric in scored.fields:
        return scored.fields[metric]
    if metric == "score" or (metric == "acc" and not scored.fields):
        return scored.function_scores
    have = ", ".join(sorted(scored.fields)) or "none: it returns a plain score"
    raise RewardError(
        f"algorithm.filter_groups.metric={metric}: not a numeric field the reward function "
        f"returns ({have}); use seq_reward, acc, or one of those"
    )


def fill_with_groups(run: Run, step: int, prompts, batch: StepBatch, samples, scored, more, timer):
    """DAPO's dynamic sampling (verl-recipe's DAPO trainer): keep the groups whose filter
    metric varies (or that hold one response), generate and score ``more()`` prompts until
    ``data.train_batch_size`` groups are kept, and train on the first that many. Past
    ``filter_groups.max_num_gen_batches`` (> 0) generation batches the step fails, as in verl.
    With an engine on ranks of its own asked ahead, ``more()`` hands over the batch asked
    ahead next (generated meanwhile, with the weights of its request) and asks for another:
    the steps consume one stream of generation batches, in the sampler's order, so the state a
    checkpoint saves (after the last batch consumed) resumes without skipping a prompt.
    Returns the step's ``(batch, samples, prompts, scored, metrics)``; the metrics include the
    multi-turn ones over all generation batches (trajectory-weighted means, summed totals)."""
    from megarl.algo.filter_groups import kept_group_rows
    from megarl.rollout.multi_turn_output import merge_multi_turn_metrics

    cfg = run.cfg
    fg, want = cfg.algorithm.filter_groups, cfg.data.train_batch_size
    parts, generated, kept_groups, gen_batches = [], 0, 0, 1
    rollouts = [(samples.metrics, len(samples.samples))]  # multi-turn metrics of every batch
    staleness = [] if run.ahead is None else [run.ahead.version - run.ahead.last_version]
    while True:
        keep = kept_group_rows(filter_metric(fg.metric, scored), batch.prompt_ids)
        rows = torch.nonzero(keep).flatten().tolist()
        groups = sorted({int(batch.prompt_ids[r]) for r in rows})
        generated += len(set(batch.prompt_ids.tolist()))
        kept_groups += len(groups)
        parts.append((prompts, samples, scored, rows))
        if kept_groups >= want:
            break
        if 0 < fg.max_num_gen_batches <= gen_batches:
            raise RuntimeError(
                f"dynamic sampling: {gen_batches} generation batches kept {kept_groups} of the "
                f"data.train_batch_size={want} groups (algorithm.filter_groups."
                f"max_num_gen_batches={fg.max_num_gen_batches}); the data may be too hard or too "
                "easy; max_num_gen_batches=0 keeps generating"
            )
        gen_batches += 1
        prompts, label = more()
        # asked ahead: the request's own seed and number; else one seed per generation batch
        seed = cfg.trainer.seed + (gen_batches - 1 if label is None else 0)
        engine = run.engine_residency  # colocated vLLM, asleep since the scoring
        if run.last_sleep_level == 2 and engine is not None and not engine.weights:
            enter(run, "sync", step=step)  # that sleep dropped its weights: the actor's again
            with timer("update_weights"):  # (not updated yet this step: the same weights)
                sync_engine(run)
        enter(run, "generate", step=step)
        with timer("gen"):
            batch, samples = generate(
                run.engine, prompts, n=cfg.actor_rollout_ref.rollout.n,
                sampling=training_sampling(run), seed=seed,
                step=step if label is None else label, pad_token_id=pad_token_id(run.tokenizer),
                image_width=run.image_width,
            )  # fmt: skip
        prescored = None
        if run.ahead is not None:
            staleness.append(run.ahead.version - run.ahead.last_version)
            prescored = run.ahead.prescored
        enter(run, "reward", step=step)
        with timer("reward"):
            scored = score(run, prompts, samples, batch, step, dump=None, prescored=prescored)
        rollouts.append((samples.metrics, len(samples.samples)))
    batch, samples, prompts, scored = _join_groups(run, parts, want)
    metrics = {
        "train/num_gen_batches": float(gen_batches),
        "dynamic_sampling/generated_groups": float(generated),
        "dynamic_sampling/kept_groups": float(kept_groups),
        "dynamic_sampling/dropped_groups": float(generated - kept_groups),
        # over every trajectory generated (these replace the first batch's, logged before)
        **merge_multi_turn_metrics(rollouts),
    }
    if staleness:  # over the generation batches the step consumed
        metrics["async/staleness_max"] = float(max(staleness))
        metrics["async/staleness_mean"] = sum(staleness) / len(staleness)
    return batch, samples, prompts, scored, metrics


def _join_groups(run: Run, parts, want: int):
    """The first ``want`` kept groups of the generation batches ``parts`` (``(prompts,
    samples, scored, kept rows)`` each) as one step batch, groups renumbered 0..want-1, with
    the routing the engine captured for each kept response (R3)."""
    new_prompts, new_samples, picks = [], [], []
    for prompts, samples, scored, rows in parts:
        taken = []
        for r in rows:
            s = samples.samples[r]
            if s.sample_index == 0:
                if len(new_prompts) == want:
                    break
                new_prompts.append(prompts[s.prompt_index])
            pid = len(new_prompts) - 1
            new_samples.append(dataclasses.replace(s, prompt_index=pid, prompt_id=pid))
            taken.append(r)
        picks.append((scored, taken))
    batch = batch_from_samples(new_samples, pad_token_id=pad_token_id(run.tokenizer))
    samples = dataclasses.replace(parts[0][1], samples=new_samples)
    batch.rollout_routing = captured_routing(samples, batch.input_ids.shape[1])  # R3: theirs
    if run.image_width is not None:  # each kept response's prompt's images
        batch.images = prompt_images(new_prompts, new_samples, run.image_width)
    scored = result_rows(
        picks, [new_prompts[s.prompt_index].data_source for s in new_samples],
        [len(s.response_token_ids) for s in new_samples], batch.response_mask.shape[1],
    )  # fmt: skip
    return batch, samples, new_prompts, scored


def staleness_metrics(run: Run, samples=()) -> dict[str, float]:
    """An engine on ranks of its own: weight syncs between the weights that generated the batch
    and now (0 when it was not asked ahead), as the mean and max over the samples (verl's
    fully-async names), and the waits. Partial rollouts (samples with ``token_versions``): a
    sample's staleness is its oldest token's, and per token too; ``async/min_version`` /
    ``max_version`` are verl's ``min_global_steps`` / ``max_global_steps`` over the batch, and
    ``async/partial_fraction`` the share of samples sampled by more than one version."""
    engine = run.ahead
    assert engine is not None
    versions = [s.token_versions for s in samples if s.token_versions]
    if versions:
        oldest = torch.tensor([min(v) for v in versions], dtype=torch.float64)
        tokens = torch.tensor([x for v in versions for x in v], dtype=torch.float64)
        stale, token_stale = engine.version - oldest, engine.version - tokens
        metrics = {"async/staleness_mean": float(stale.mean()),
                   "async/staleness_max": float(stale.max()),
                   "async/token_staleness_mean": float(token_stale.mean()),
                   "async/token_staleness_max": float(token_stale.max()),
                   "async/min_version": float(tokens.min()), "async/max_version": float(tokens.max()),
                   "async/partial_fraction": sum(len(set(v)) > 1 for v in versions) / len(versions)}  # fmt: skip
    else:
        staleness = float(engine.version - engine.last_version)
        metrics = {"async/staleness_mean": staleness, "async/staleness_max": staleness}
    metrics["async/wait_rollout_s"] = engine.waited_s
    for key, value in engine.rollout_timing.items():
        name = f"async/rollout_{key}" if key == "interruptions" else f"async/rollout_{key}_s"
        metrics[name] = float(value)
    return metrics


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
        image_width=run.image_width,
    )
    scored = score(run, prompts, samples, batch, step, dump=cfg.trainer.validation_data_dir)
    if cfg.trainer.log_val_generations > 0 and run.rank == 0:
        log_val_generations(run, samples, scored.scores.tolist(), step)
    sources = [prompts[s.prompt_index].data_source for s in samples]
    metrics = {"val/score/mean": float(scored.scores.mean())}
    for source in sorted(set(sources)):
        rows = torch.tensor([s == source for s in sources])
        metrics[f"val-core/{source}/reward/mean@{val.n}"] = float(scored.scores[rows].mean())
    return metrics


def log_val_generations(run: Run, samples, scores: list[float], step: int) -> None:
    """``trainer.log_val_generations``: verl's choice of validation samples (prompt and response
    decoded without special tokens, as verl's) appended to the run directory's
    ``val_generations.jsonl``."""
    from megarl.reward.dump import pick_val_generations, write_val_generations

    decode = run.tokenizer.decode
    inputs = [decode(s.prompt_token_ids, skip_special_tokens=True) for s in samples]
    outputs = [decode(s.response_token_ids, skip_special_tokens=True) for s in samples]
    chosen = pick_val_generations(inputs, outputs, scores, run.cfg.trainer.log_val_generations)
    write_val_generations(run.run_dir, step, chosen)


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
    assert run.ahead is not None
    prefetch(run.ahead, prompts, requests, seed=cfg.trainer.seed, step=step)


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
        image_width=run.image_width,
    )


def greedy_sampling(run: Run) -> dict[str, float | int]:
    """ReMax's greedy decoding of the training prompts (verl: ``do_sample=False``)."""
    return {**training_sampling(run), "temperature": 0.0, "top_p": 1.0, "top_k": -1}


def greedy_baselines(
    run: Run, prompts: Sequence[PromptSample], greedy: StepBatch, samples, step: int
) -> torch.Tensor:
    """ReMax: each response's baseline is its prompt's greedy score (``reward_baselines [B]``)."""
    scored = score(run, prompts, samples, greedy, step, dump=None)
    return scored.scores.repeat_interleave(run.cfg.actor_rollout_ref.rollout.n)


def first_sync(run: Run) -> None:
    """Before anything generates: the engine slept (level 2) since its start; give it the actor's
    weights (the initial ones, or a resumed checkpoint's)."""
    enter(run, "sync")
    sync_engine(run)
    if run.ahead is not None:
        run.ahead.version_steps[run.ahead.version] = run.state.step


def sync_engine(run: Run):
    """Push the actor's weights into the rollout engine (nothing to do when it is the actor);
    the sync's ``SyncStats`` or None."""
    if run.reshard_plan is None:
        return None
    if run.vision is not None:  # a VL actor: its vision tower first, then the language model
        from megarl.rollout.reshard.vision_sync import sync_vision_language_weights

        return sync_vision_language_weights(run.vision, run.reshard_plan, run.engine)
    from megarl.rollout.reshard import sync_weights

    return sync_weights(run.actor.chunks, run.reshard_plan, run.engine)


def training_sampling(run: Run) -> dict[str, float | int]:
    roll = run.cfg.actor_rollout_ref.rollout
    return {
        "temperature": roll.temperature if roll.do_sample else 0.0,
        "top_p": roll.top_p,
        "top_k": roll.top_k,
        "max_tokens": roll.response_length,
    }


def penalize_kl(run: Run, batch: StepBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """``algorithm.use_kl_in_reward``: the token rewards less β·KL(π_old ‖ π_ref) (the rollout's
    log-probs in bypass mode), and the controller's update from the global mean KL with n_steps
    = the batch's responses, as verl."""
    from megarl.algo import apply_kl_penalty

    coef = run.kl_ctrl.value
    rewards, current_kl = apply_kl_penalty(
        batch.token_level_scores,
        batch.old_log_probs,
        batch.ref_log_probs,
        batch.response_mask,
        kl_coef=coef,
        kl_penalty=run.cfg.algorithm.kl_penalty,
    )
    run.kl_ctrl.update(float(current_kl), n_steps=len(batch))
    return rewards, {"actor/reward_kl_penalty": float(current_kl),
                     "actor/reward_kl_penalty_coeff": coef}  # fmt: skip
