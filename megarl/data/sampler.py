"""The global-batch sampler: which prompts make up each training step, resumable exactly.

Every rank builds the same sampler and takes the same global batch of dataset indices per step
(the trainer then splits it over rollout DP ranks). Epoch ``e`` visits the prompts in the order
``numpy.random.default_rng([seed, e]).permutation(n)`` (or ``0..n-1`` without shuffling), cut
into batches of ``batch_size``. Unlike verl (one torch generator running across epochs), each
epoch's order comes from (seed, epoch) alone, so the resumable state is just (epoch, batch within
epoch); the orders themselves differ from verl's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["GlobalBatchSampler", "total_training_steps"]


class GlobalBatchSampler:
    """Iterator of global batches (lists of dataset indices); see the module docstring.

    ``drop_last`` drops a final partial batch (verl drops it for training). The iterator walks
    epochs without end; the trainer stops after :func:`total_training_steps` batches.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"data.train_batch_size must be >= 1, got {batch_size}")
        if num_samples < batch_size and drop_last:
            raise ValueError(
                f"data.train_batch_size={batch_size} exceeds the {num_samples} prompts of the "
                "dataset: no full batch"
            )
        if num_samples < 1:
            raise ValueError("the dataset is empty")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order: np.ndarray | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in one epoch."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order in which epoch ``epoch`` visits the dataset."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def __iter__(self) -> GlobalBatchSampler:
        return self

    def __next__(self) -> list[int]:
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch, self.batch_in_epoch, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        start = self.batch_in_epoch * self.batch_size
        batch = self._order[start : start + self.batch_size].tolist()
        self.batch_in_epoch += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Position (epoch, batches taken in it) plus what must match on load."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next batch is the one after the last one taken."""
        for key, config_key in (
            ("seed", "data.seed"),
            ("num_samples", "the dataset size"),
            ("batch_size", "data.train_batch_size"),
            ("shuffle", "data.shuffle"),
            ("drop_last", "drop_last"),
        ):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the prompt order: {config_key} was {state[key]} in the "
                    f"checkpoint and is {getattr(self, key)} now"
                )
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self._order = None


def total_training_steps(batches_per_epoch: int, total_epochs: int, override: int | None) -> int:
    """``trainer.total_training_steps`` if set, else batches per epoch x ``trainer.total_epochs``."""
    return override if override is not None else batches_per_epoch * total_epochs
