"""Scoring a batch: the run's reward manager (rule scorers, a user's function, or a learned
reward model's scores), or the scores the rollout ranks computed for a batch asked ahead; and
what a step does when scorings time out.
"""

from __future__ import annotations

import os

from megarl.reward import RewardResult
from megarl.reward.manager import RewardError, reward_inputs
from megarl.trainer.batch import StepBatch


def score(run, prompts, samples, batch: StepBatch, step: int, dump, prescored=None) -> RewardResult:
    """The batch's rewards: ``prescored`` when the rollout ranks scored it (a
    ``RewardResult``, or their scorer's one-line error), else the run's reward manager's."""
    if prescored is not None:
        if isinstance(prescored, str):
            raise RewardError(prescored)
        check_timeouts(run, prescored, step)
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
    check_timeouts(run, scored, step)
    return scored


TIMEOUT_WARNING_SHARE = 0.5
"""A step whose share of timed-out scorings exceeds this warns on the console."""
ALLOW_ALL_TIMEOUTS_ENV = "MEGARL_ALLOW_ALL_REWARD_TIMEOUTS"


def check_timeouts(run, scored: RewardResult, step: int) -> None:
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
        raise RewardError(
            f"{what}: stopping rather than training on nothing (raise the limit, fix the "
            f"scorer, or set {ALLOW_ALL_TIMEOUTS_ENV}=1 to train on)"
        )
    run.console.print(f"megarl: warning: {what}")
