"""Dataset sharding as MindSpore's datasets take it: ``num_shards`` and ``shard_id``.

``DistributedSampler(dataset, num_shards, shard_id)`` yields shard ``shard_id``'s sample indices,
the order of ``torch.utils.data.DistributedSampler`` (the same permutation on every shard for a
seed and epoch, padded by wrapping around so every shard has as many samples). In the parallel
modes one process feeds every device of the job one global batch; ``global_batches(batch_size)``
yields its indices: device ``d``'s slice of the batch (dimension 0 split into ``num_shards``
equal parts, the layout ``parallelize`` gives a model's inputs) holds shard ``d``'s samples.
``state_dict()`` / ``load_state_dict()`` save and restore the position in the epoch as a global
sample count, so a resumed run, on this or another number of shards, continues the same order
(Note [Data positions] in torchacc/distributed/data_state.py).
"""

from __future__ import annotations

import math

import torch

from torchacc.distributed.data_state import STATE_VERSION, check_state, epoch_order, resplit


class DistributedSampler(torch.utils.data.Sampler):
    def __init__(
        self, dataset, num_shards=None, shard_id=None, shuffle=True, seed=0, drop_remainder=False
    ):
        from torchacc.parallel import context

        if num_shards is None:
            num_shards = context.get_group_size()
        if shard_id is None:
            shard_id = context.get_rank()
        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"DistributedSampler: num_shards={num_shards!r} must be an int >= 1")
        if not isinstance(shard_id, int) or not 0 <= shard_id < num_shards:
            raise ValueError(
                f"DistributedSampler: shard_id={shard_id!r} must be in [0, {num_shards})"
            )
        self.dataset, self.num_shards, self.shard_id = dataset, num_shards, shard_id
        self.shuffle, self.seed, self.drop_remainder = shuffle, seed, drop_remainder
        self.epoch = 0
        n = len(dataset)
        if drop_remainder:
            self.num_samples = n // num_shards
        else:
            self.num_samples = math.ceil(n / num_shards)
        self.total_size = self.num_samples * num_shards
        self.consumed = 0  # global samples taken from this epoch's order
        self._resume = None  # (epoch, consumed) from load_state_dict, for the next pass

    def set_epoch(self, epoch):
        """A new permutation per epoch (the same on every shard)."""
        self.epoch = epoch

    def _start(self):
        """Where this epoch's next pass starts: a loaded position (once), else 0."""
        start = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            start = self._resume[1]
        self._resume = None
        self.consumed = start
        return start

    def shard(self, shard_id, start=0):
        """Shard ``shard_id``'s indices for this epoch after ``start`` global samples."""
        order = epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)
        return resplit(order, start, self.num_shards, shard_id, self.drop_remainder)

    def __iter__(self):
        for i in self.shard(self.shard_id, self._start()):
            self.consumed += self.num_shards
            yield i

    def _fields(self):
        return {"dataset_len": len(self.dataset), "seed": self.seed, "shuffle": self.shuffle}

    def state_dict(self):
        """The epoch and the global count of samples taken so far in it."""
        epoch, consumed = self._resume or (self.epoch, self.consumed)
        return {
            "kind": "DistributedSampler",
            "version": STATE_VERSION,
            "epoch": epoch,
            "consumed": consumed,
            **self._fields(),
        }

    def load_state_dict(self, state, source=None):
        """Continue at ``state``'s position: the next pass over its epoch starts there (a
        :class:`~torchacc.distributed.data_state.DataStateError` if it is another dataset's)."""
        check_state(state, "DistributedSampler", self._fields(), source)
        self.epoch = state["epoch"]
        self._resume = (state["epoch"], state["consumed"])

    def __len__(self):
        return self.num_samples

    def global_batches(self, batch_size):
        """Lists of indices of global batches of ``batch_size``: ``batch_size // num_shards``
        samples of each shard in shard order (a trailing partial batch is dropped)."""
        if batch_size % self.num_shards:
            raise ValueError(
                f"DistributedSampler.global_batches: batch_size={batch_size} does not split "
                f"into {self.num_shards} shards"
            )
        per = batch_size // self.num_shards
        begin = self._start()
        shards = [self.shard(s, begin) for s in range(self.num_shards)]
        for start in range(0, len(shards[0]) - per + 1, per):
            self.consumed += batch_size
            yield [i for s in shards for i in s[start : start + per]]
