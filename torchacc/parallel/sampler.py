"""Dataset sharding as MindSpore's datasets take it: ``num_shards`` and ``shard_id``.

``DistributedSampler(dataset, num_shards, shard_id)`` yields shard ``shard_id``'s sample indices,
the order of ``torch.utils.data.DistributedSampler`` (the same permutation on every shard for a
seed and epoch, padded by wrapping around so every shard has as many samples). In the parallel
modes one process feeds every device of the job one global batch; ``global_batches(batch_size)``
yields its indices: device ``d``'s slice of the batch (dimension 0 split into ``num_shards``
equal parts, the layout ``parallelize`` gives a model's inputs) holds shard ``d``'s samples.
"""

from __future__ import annotations

import math

import torch


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

    def set_epoch(self, epoch):
        """A new permutation per epoch (the same on every shard)."""
        self.epoch = epoch

    def _all_indices(self):
        n = len(self.dataset)
        if self.shuffle:
            gen = torch.Generator()
            gen.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=gen).tolist()
        else:
            order = list(range(n))
        if self.total_size > n:  # pad by repeating from the start
            order += (order * math.ceil((self.total_size - n) / max(n, 1)))[: self.total_size - n]
        return order[: self.total_size]

    def shard(self, shard_id):
        """Shard ``shard_id``'s indices for this epoch."""
        return self._all_indices()[shard_id : self.total_size : self.num_shards]

    def __iter__(self):
        return iter(self.shard(self.shard_id))

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
        shards = [self.shard(s) for s in range(self.num_shards)]
        for start in range(0, self.num_samples - per + 1, per):
            yield [i for s in shards for i in s[start : start + per]]
