"""Global-batch sampler: deterministic from (seed, epoch), drop_last, exact resume."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megarl.data import GlobalBatchSampler, total_training_steps


def take(sampler, k):
    return list(itertools.islice(sampler, k))


def test_same_seed_same_batches_and_each_epoch_is_a_permutation():
    a = take(GlobalBatchSampler(10, 3, seed=5), 9)
    b = take(GlobalBatchSampler(10, 3, seed=5), 9)
    assert a == b
    assert all(len(batch) == 3 for batch in a)
    for epoch in range(3):  # 3 full batches per epoch, the 10th prompt dropped
        seen = [i for batch in a[3 * epoch : 3 * epoch + 3] for i in batch]
        assert len(set(seen)) == 9 and set(seen) <= set(range(10))
    assert a != take(GlobalBatchSampler(10, 3, seed=6), 9)


def test_each_epoch_has_its_own_permutation_from_seed_and_epoch():
    s = GlobalBatchSampler(8, 4, seed=1)
    epochs = [s.epoch_order(e).tolist() for e in range(3)]
    assert len({tuple(e) for e in epochs}) == 3
    assert all(sorted(e) == list(range(8)) for e in epochs)
    # independent reference: numpy's generator seeded with [seed, epoch]
    assert epochs[2] == np.random.default_rng([1, 2]).permutation(8).tolist()
    assert take(s, 4) == [epochs[0][:4], epochs[0][4:], epochs[1][:4], epochs[1][4:]]


def test_no_shuffle_walks_in_order_and_drop_last_false_keeps_the_tail():
    s = GlobalBatchSampler(5, 2, shuffle=False, drop_last=False)
    assert s.batches_per_epoch == 3
    assert take(s, 4) == [[0, 1], [2, 3], [4], [0, 1]]
    assert GlobalBatchSampler(5, 2, drop_last=True).batches_per_epoch == 2


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 7])
def test_resume_after_k_batches_continues_exactly_across_epochs(k):
    uninterrupted = take(GlobalBatchSampler(7, 3, seed=11), 10)  # 2 batches per epoch
    first = GlobalBatchSampler(7, 3, seed=11)
    take(first, k)
    state = first.state_dict()
    fresh = GlobalBatchSampler(7, 3, seed=11)
    fresh.load_state_dict(state)
    assert take(fresh, 10 - k) == uninterrupted[k:]


def test_resume_refuses_a_changed_batch_size_or_seed():
    state = GlobalBatchSampler(7, 3, seed=11).state_dict()
    with pytest.raises(ValueError, match="data.train_batch_size was 3 in the checkpoint and is 2"):
        GlobalBatchSampler(7, 2, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="data.seed was 11"):
        GlobalBatchSampler(7, 3, seed=12).load_state_dict(state)


def test_batch_larger_than_the_dataset_is_named():
    with pytest.raises(ValueError, match="data.train_batch_size=8 exceeds the 5 prompts"):
        GlobalBatchSampler(5, 8)


def test_total_training_steps_defaults_to_batches_per_epoch_times_epochs():
    assert total_training_steps(GlobalBatchSampler(10, 3).batches_per_epoch, 4, None) == 12
    assert total_training_steps(3, 4, 5) == 5
