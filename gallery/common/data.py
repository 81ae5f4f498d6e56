"""Per-rank, resumable batching shared by the gallery models.

The order of an epoch is ``DistributedSampler(shuffle=True, seed, drop_last=True)`` after
``set_epoch(epoch)``: each rank gets a disjoint shard, and the order depends only on
(seed, epoch), so a resumed run can skip straight to batch ``k`` of an epoch and see exactly the
batches an uninterrupted run would have seen. Datasets with a ``get_batch(indices)`` method (the
in-memory mock sets) are batched directly; others go through a ``DataLoader`` with workers.

``state_dict(epoch, step)`` is that position as a global sample count (``step * batch_size *
world_size``) with the dataset's length and the seed; ``load_state_dict`` checks them and gives
back ``(epoch, step)`` for this run's world size. Global batch ``k`` of an epoch is the same block
of the epoch's order on every world size (Note [Data positions] in
torchacc/distributed/data_state.py), so a run resumed on another number of processes with the
same global batch sees the samples the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler

from gallery.common.launchlib import torchacc_data_state

_data_state = torchacc_data_state()  # by file: the eager path must not import torchacc
STATE_VERSION = _data_state.STATE_VERSION
DataStateError = _data_state.DataStateError
check_state = _data_state.check_state

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

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.sampler.num_replicas

    def _fields(self) -> dict:
        return {
            "dataset_len": len(self.dataset),
            "seed": self.sampler.seed,
            "shuffle": self.sampler.shuffle,
        }

    def state_dict(self, epoch: int, step: int) -> dict:
        """The position before batch ``step`` of ``epoch`` (Note [Data positions]); with the
        dataset's own state when it has one (what identifies it)."""
        state = {
            "kind": "EpochBatches",
            "version": STATE_VERSION,
            "epoch": epoch,
            "consumed": step * self.global_batch,
            **self._fields(),
        }
        if hasattr(self.dataset, "state_dict"):
            state["dataset"] = self.dataset.state_dict()
        return state

    def load_state_dict(self, state: dict, source=None) -> tuple[int, int]:
        """``(epoch, step)`` of a saved position in this run (its world size, its batch)."""
        check_state(state, "EpochBatches", self._fields(), source)
        if "dataset" in state and hasattr(self.dataset, "load_state_dict"):
            self.dataset.load_state_dict(state["dataset"], source=source)
        consumed = state["consumed"]
        if consumed % self.global_batch:
            where = f"{source}: " if source else ""
            raise DataStateError(
                f"{where}EpochBatches state: {consumed} samples of epoch {state['epoch']} were "
                f"consumed, not a whole number of this run's global batches of {self.global_batch}"
                f" ({self.batch_size} x {self.sampler.num_replicas} processes); nothing was changed"
            )
        return state["epoch"], consumed // self.global_batch

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
