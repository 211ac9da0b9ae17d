"""verl's fully-async schedule in megarl's steps (megarl.config.async_schedule): which batches a
step may ask for, when the weights sync, when validation and checkpoints come; and verl's
fully-async Megatron recipe's keys validating (tests/config/test_verl_examples.py runs the whole
script)."""

from __future__ import annotations

import pytest

from megarl.config import load_config
from megarl.config.async_schedule import (
    ask_limit,
    asks_ahead,
    at_frequency,
    describe_overlap,
    extra_batches,
    syncs_after,
)
from megarl.config.batch_plan import stages_weight_updates
from megarl.config.validate import validate
from tests.config._bad_configs import GRPO, ROLL

SPLIT = [f"{ROLL}.nnodes=1", f"{ROLL}.n_gpus_per_node=1", f"{ROLL}.tensor_model_parallel_size=1"]


def _cfg(k: int, staleness: float, partial: bool = False):
    cfg = load_config(GRPO, [*SPLIT, f"async_training.trigger_parameter_sync_step={k}",
                             f"async_training.staleness_threshold={staleness}",
                             f"async_training.partial_rollout={str(partial).lower()}"])  # fmt: skip
    validate(cfg, 2)
    return cfg


@pytest.mark.parametrize(
    ("k", "staleness", "limits"),
    [
        (1, 0, [1, 2, 3, 4, 5, 6]),  # on-policy: nothing asked ahead
        (1, 1, [2, 3, 4, 5, 6, 7]),  # one step off
        (1, 2, [3, 4, 5, 6, 7, 8]),  # two steps off
        (2, 0, [2, 2, 4, 4, 6, 6]),  # a window's batches with its weights, none of the next
        (2, 0.5, [3, 3, 5, 5, 7, 7]),  # (1 + 0.5) x 2 = 3 batches per window
        (4, 0.1, [5, 5, 5, 5, 9, 9]),  # verl's recipe default: ceil(0.4) = 1 batch more
        (4, 0.5, [6, 6, 6, 6, 10, 10]),  # verl's fully-async Megatron script
    ],
)
def test_each_step_asks_for_the_batches_the_staleness_bound_allows(k, staleness, limits):
    """During step i of window w = (i-1)//K the batches up to K(w+1) + ceil(s·K) may be asked:
    at most (1 + s)·K batches generated per sync, verl's rule; K = 1 is one-step-off's rule."""
    cfg = _cfg(k, staleness)
    assert [ask_limit(cfg, step) for step in range(1, 7)] == limits
    assert asks_ahead(cfg) == (limits[0] > 1)


@pytest.mark.parametrize(("k", "syncs"), [(1, [1, 2, 3, 4, 5]), (2, [2, 4, 5]), (4, [4, 5])])
def test_the_weights_sync_every_k_updates_and_at_the_end(k, syncs):
    cfg = _cfg(k, 0.5)
    assert [s for s in range(1, 6) if syncs_after(cfg, s, 5)] == syncs


def test_test_and_save_frequencies_count_weight_syncs():
    """verl's fully-async trainer validates and saves every test_freq / save_freq parameter
    versions: every freq·K steps."""
    cfg = _cfg(2, 0.5)
    assert [s for s in range(1, 13) if at_frequency(cfg, s, 3)] == [6, 12]
    assert not any(at_frequency(cfg, s, -1) for s in range(1, 13))
    assert [s for s in range(1, 5) if at_frequency(_cfg(1, 0), s, 2)] == [2, 4]


def test_partial_rollouts_never_stage_and_far_bounds_do():
    """A batch asked two weight versions ahead needs the rollout ranks' staging slot; partial
    rollouts load every update when it comes instead."""
    assert not stages_weight_updates(_cfg(2, 1))  # one version ahead at most
    assert stages_weight_updates(_cfg(2, 1.5))  # ceil(3) = 3 > K = 2: two versions ahead
    assert stages_weight_updates(_cfg(1, 2))  # two steps off, as before
    assert not stages_weight_updates(_cfg(2, 1.5, partial=True))
    assert extra_batches(_cfg(2, 1.5)) == 3


def test_the_console_line_says_how_the_run_overlaps():
    assert describe_overlap(_cfg(1, 1)) == "one step off"
    assert describe_overlap(_cfg(4, 0.5, partial=True)) == (
        "fully async, weights synced every 4 update(s), partial rollouts"
    )
    assert describe_overlap(_cfg(2, 0)) == "fully async, weights synced every 2 update(s)"


def test_verl_fully_async_keys_validate():
    """The recipe's async_training.* and top-level rollout.* keys: total_rollout_steps sets the
    steps (prompts / batch), data.train_batch_size=0 takes require_batches mini-batches."""
    cfg = load_config(GRPO, [*SPLIT, "data.train_batch_size=0", "async_training.require_batches=2",
                             "rollout.total_rollout_steps=80", "trainer.total_training_steps=null",
                             "async_training.trigger_parameter_sync_step=4",
                             "async_training.partial_rollout=true",
                             "async_training.staleness_threshold=0.5"])  # fmt: skip
    validate(cfg, 2)
    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cfg.data.train_batch_size == 2 * mini
    assert cfg.trainer.total_training_steps == 80 // (2 * mini)
