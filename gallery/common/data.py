"""Per-rank, resumable batching shared by the gallery models.

The order of an epoch is ``DistributedSampler(shuffle=True, seed, drop_last=True)`` after
``set_epoch(epoch)``: each rank gets a disjoint shard, and the order depends only on
(seed, epoch), so a resumed run can skip straight to batch ``k`` of an epoch and see exactly the
batches an uninterrupted run would have seen. Datasets with a ``get_batch(indices)`` method (the
in-memory mock sets) are batched directly; others go through a ``DataLoader`` with workers.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["EpochBatches"]


class EpochBatches:
    def __init__(
        self,
        dataset,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        *,
        shuffle: bool = True,
        workers: int = 0,
        pin_memory: bool = False,
    ):
        self.dataset = dataset
        self.batch_size = batch_size
        self.workers = workers
        self.pin_memory = pin_memory
        self.sampler = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=True,
        )
        self.steps_per_epoch = len(self.sampler) // batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"dataset of {len(dataset)} samples is too small for {world_size} process(es) "
                f"x batch {batch_size}: not one full batch per process"
            )

    def __len__(self) -> int:
        return self.steps_per_epoch

    def batches(self, epoch: int, start: int = 0, stop: int | None = None) -> Iterator:
        """Batches ``start`` .. ``stop - 1`` of ``epoch`` (CPU tensors); ``stop`` defaults to the
        end of the epoch."""
        self.sampler.set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        indices = list(self.sampler)
        bs = self.batch_size
        end = self.steps_per_epoch if stop is None else min(stop, self.steps_per_epoch)
        plan = [indices[i * bs : (i + 1) * bs] for i in range(start, end)]
        if hasattr(self.dataset, "get_batch"):
            for batch in plan:
                yield self.dataset.get_batch(torch.tensor(batch, dtype=torch.long))
            return
        loader = DataLoader(
            self.dataset,
            batch_sampler=plan,
            num_workers=self.workers,
            pin_memory=self.pin_memory,
            prefetch_factor=4 if self.workers > 0 else None,
        )
        yield from loader
