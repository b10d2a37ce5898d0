"""The random data every variant trains on, drawn the same way for every variant and rank count.

A training set of `samples` standard-normal (input, target) sequences [samples, seq_len, d_model]
is drawn once from the seed; each epoch visits it in a seeded order, `batch_size` sequences (the
global batch) per step, and rank r of N takes rows [r*B/N, (r+1)*B/N) of every global batch.
So N ranks see exactly the batches one process sees, and a run is reproducible from its seed.
The held-out (test) batch comes from its own seed and is never a training sample.
"""

from __future__ import annotations

import torch

from moebench.config import TrainConfig, derived_seed

DATA_SEED_OFFSET = 101
"""The training data comes from seed + this (weights from the seed), so they never share a stream."""
TEST_SEED_OFFSET = 1_000_003
"""The held-out batch comes from seed + this: never a training sample."""
ORDER_SEED_PRIME = 7919
"""Epoch e's order is drawn from seed * this + e: a different order every epoch."""


def random_dataset(train: TrainConfig, d_model: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`samples` standard-normal (input, target) sequences [samples, seq_len, d_model]."""
    gen = torch.Generator().manual_seed(derived_seed(train.seed + DATA_SEED_OFFSET))
    shape = (train.samples, train.seq_len, d_model)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def held_out_batch(train: TrainConfig, d_model: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One (batch_size, seq_len, d_model) test batch and its target: (32, 8, 512) in the chapter."""
    gen = torch.Generator().manual_seed(derived_seed(train.seed + TEST_SEED_OFFSET))
    shape = (train.batch_size, train.seq_len, d_model)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def epoch_order(train: TrainConfig, epoch: int) -> torch.Tensor:
    """The sample order of one epoch (the same on every rank)."""
    seed = derived_seed(train.seed * ORDER_SEED_PRIME + epoch)
    return torch.randperm(train.samples, generator=torch.Generator().manual_seed(seed))


def rank_rows(batch_size: int, rank: int, world_size: int) -> slice:
    """Rank `rank`'s rows of a global batch (equal slices; batch_size divides by world_size)."""
    share = batch_size // world_size
    return slice(rank * share, (rank + 1) * share)


class Batches:
    """The global batch of every step, and this rank's share of it."""

    def __init__(self, train: TrainConfig, d_model: int, *, rank: int, world_size: int) -> None:
        self.train = train
        self.inputs, self.targets = random_dataset(train, d_model)
        self.rows = rank_rows(train.batch_size, rank, world_size)
        self._order: tuple[int, torch.Tensor] | None = None

    def epoch_of(self, step: int) -> int:
        return step // self.train.steps_per_epoch

    def rank_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (input, target) rows of global step `step` (0-based)."""
        epoch = self.epoch_of(step)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.train, epoch))
        first = (step % self.train.steps_per_epoch) * self.train.batch_size
        idx = self._order[1][first:first + self.train.batch_size][self.rows]
        return self.inputs[idx], self.targets[idx]

    def data_range(self) -> dict:
        """Smallest and largest input and target values (the chapter quotes both): over the whole
        training set, and over the first global batch (`batch_*`), the one tensor of the size the
        chapter printed. Extremes grow with the sample count (about sqrt(2 ln n)), so only the
        same-size tensor compares with the chapter's ranges."""
        x, y = self.global_batch(0)
        return {"input_min": self.inputs.min().item(), "input_max": self.inputs.max().item(),
                "target_min": self.targets.min().item(), "target_max": self.targets.max().item(),
                "batch_input_min": x.min().item(), "batch_input_max": x.max().item(),
                "batch_target_min": y.min().item(), "batch_target_max": y.max().item()}

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's rows of global step `step` (0-based)."""
        order = epoch_order(self.train, self.epoch_of(step))
        first = (step % self.train.steps_per_epoch) * self.train.batch_size
        idx = order[first:first + self.train.batch_size]
        return self.inputs[idx], self.targets[idx]


def seed_rank_randomness(seed: int, rank: int) -> None:
    """Seed torch's global generator for what a rank draws while training (gate noise, random
    routing): reproducible for a seed, and a different stream on every rank."""
    torch.manual_seed(derived_seed(seed + 1 + rank))
