"""``torch_xla.distributed.parallel_loader`` on torchacc: ``MpDeviceLoader`` / ``ParallelLoader``.

::

    train_loader = pl.MpDeviceLoader(train_loader, device)
    for x, y in train_loader:          # batches are already on the device
        loss = loss_fn(model(x), y)
        ...                            # no mark_step needed: the loader syncs once per batch

A background thread iterates the wrapped loader and copies each batch's tensors to the device
(``jax.device_put``, which does not wait for the device), keeping up to ``device_prefetch_size``
batches ready; so host-side loading and the upload of batch ``n+1`` overlap with step ``n``. As in
torch_xla, taking the next batch first runs ``mark_step()`` (every ``batches_per_execution``
batches), so a training loop over the loader needs no explicit sync; the loader also syncs when it
is exhausted. Batches may be tensors or (nested) lists / tuples / dicts of them; other values pass
through unchanged.

In SPMD mode ``input_sharding`` lays each batch out as it is uploaded (every device gets only its
shard). In a job of several processes every batch is this process's share of the global batch
(a ``DistributedSampler`` per rank), whatever ``ShardingSpec.minibatch`` says: the global array's
dimension 0 is every process's batch in process order (Note [Per-process batches] in
torchacc/sharding/data.py); without ``input_sharding`` it is split over every mesh axis.
"""

from __future__ import annotations

import torch

from torchacc.engine.transfer import upload_waiting
from torchacc.lazy.device import DEVICE_TYPE

# the prefetch loop (background thread, bounded queue), shared with torchacc.AsyncLoader, and the
# upload (any thread, laid out per process) and wrapping as torchacc tensors (the recording thread)
from torchacc.lazy.prefetch import END as _END
from torchacc.lazy.prefetch import Prefetcher
from torchacc.sharding.data import BatchAgreement, batch_layout
from torchacc.sharding.data import upload_tree as _upload_tree
from torchacc.sharding.data import wrap_tree as _wrap_tree


class PerDeviceLoader:
    """The iterator over one device's batches (``ParallelLoader.per_device_loader``)."""

    def __init__(self, loader, device):
        self._loader = loader
        self._device = device
        self._mark_step_batch_count = loader.batches_per_execution - 1
        self._batches_yielded = 0

    def __iter__(self):
        return self

    def __next__(self):
        return self.next()

    def __len__(self):
        return self._loader.per_device_samples()

    def next(self):
        from torchacc.torch_xla.core import xla_model as xm

        if self._mark_step_batch_count <= self._batches_yielded:
            self._batches_yielded = 0
            xm.mark_step()
        else:
            self._batches_yielded += 1
        item = self._loader._next_item()
        if item is _END:
            xm.mark_step()
            raise StopIteration
        return item


class ParallelLoader:
    """Wraps a host loader; ``per_device_loader(device)`` yields its batches on the device.

    ``loader_prefetch_size``, ``host_to_device_transfer_threads`` are accepted for torch_xla
    compatibility; one background thread (the lazy frontend's prefetch loop,
    torchacc/lazy/prefetch.py) both iterates the loader and uploads, holding at most
    ``device_prefetch_size`` uploaded batches.
    """

    def __init__(
        self,
        loader,
        devices,
        batchdim=0,
        batches_per_execution=1,
        loader_prefetch_size=16,
        device_prefetch_size=8,
        host_to_device_transfer_threads=1,
        input_sharding=None,
    ):
        import torchacc

        self._input_sharding = input_sharding
        devices = [torch.device(d) for d in devices]
        if len(devices) != 1 or devices[0].type not in (DEVICE_TYPE, "xla"):
            raise ValueError(
                f"ParallelLoader: expected this process's one torchacc device, got {devices}"
            )
        if batches_per_execution < 1:
            raise ValueError("ParallelLoader: batches_per_execution must be >= 1")
        self._loader = loader
        self._devices = devices
        self._batchdim = batchdim
        self._batches_per_execution = batches_per_execution
        torchacc.jax_device()  # pick (and join a multi-process job for) the device on this thread
        upload_waiting()  # the loop it feeds starts: Note [Deferred uploads]
        layout = batch_layout(input_sharding)
        self._prefetch = Prefetcher(
            loader,
            device_prefetch_size,
            upload=lambda batch: _upload_tree(batch, layout),
            wrap=_wrap_tree,
            check=BatchAgreement().check,  # the processes agree on each batch's shapes
            name="torchacc-loader",
        )
        self._thread = self._prefetch.thread

    @property
    def batches_per_execution(self):
        return self._batches_per_execution

    def per_device_loader(self, device):
        if torch.device(device) != self._devices[0]:
            raise ValueError(f"ParallelLoader: {device} is not this loader's device")
        return PerDeviceLoader(self, device)

    def per_device_samples(self):
        return len(self._loader)

    def close(self):
        """Stop the background thread (batches not yet taken are dropped)."""
        self._prefetch.close()

    def _next_item(self):
        batch = self._prefetch.get()
        if batch is not _END and self._input_sharding is not None:
            _shard_batch(batch, self._input_sharding)
        return batch


def _shard_batch(batch, input_sharding):
    """torch_xla's ``input_sharding``: one ``xs.ShardingSpec`` for every tensor of the batch it
    fits (same rank), or a dict of them per key of a dict batch (SPMD mode)."""
    if isinstance(input_sharding, dict):
        if not isinstance(batch, dict):
            raise ValueError(
                f"ParallelLoader: input_sharding is a dict (keys {sorted(input_sharding)}) but "
                f"the batch is a {type(batch).__name__}, not a dict"
            )
        for key, tensor in batch.items():
            if key not in input_sharding:
                raise KeyError(
                    f"ParallelLoader: batch key {key!r} has no entry in input_sharding "
                    f"(keys {sorted(input_sharding)})"
                )
            input_sharding[key].apply(tensor)
        return
    for tensor in _tensors(batch):
        if input_sharding.can_apply(tensor):
            input_sharding.apply(tensor)
        else:  # the loader lays it out replicated
            input_sharding.replicate(tensor)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


class MpDeviceLoader:
    """``for batch in MpDeviceLoader(loader, device)``: a fresh ``ParallelLoader`` per epoch."""

    def __init__(self, loader, device, **kwargs):
        upload_waiting()  # the loop it feeds starts: Note [Deferred uploads]
        self._loader = loader
        self._device = device
        self._parallel_loader_kwargs = kwargs

    def __iter__(self):
        parallel_loader = ParallelLoader(
            self._loader, [self._device], **self._parallel_loader_kwargs
        )
        return parallel_loader.per_device_loader(self._device)

    def __len__(self):
        return len(self._loader)
