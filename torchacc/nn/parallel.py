"""``torchacc.nn.parallel.DistributedDataParallel``: torch's DDP for a module on CPU or CUDA; for a
module on the torchacc device, the same contract (replicas start from rank 0's parameters and
buffers; after ``backward()`` every gradient is the average over ranks) with the gradients reduced
by one collective recorded in the step, as ``xm.reduce_gradients`` does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchacc.lazy.tensor import LazyTensor
from torchacc.sharding import collectives as C


class _LazyDDP(nn.Module):
    def __init__(self, module, broadcast_buffers=True):
        super().__init__()
        self.module = module
        self._world = C.world_size()
        self._queued = False
        if self._world > 1:
            tensors = list(module.parameters())
            if broadcast_buffers:
                tensors += list(module.buffers())
            C.start_equal([t.data for t in tensors], 0)  # Note [One gradient average, one start]
            for p in module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p):
        if not self._queued:  # once per backward: reduce when autograd is done
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    def _reduce(self):
        self._queued = False
        C.average_gradients([p.grad for p in self.module.parameters()], 1.0 / self._world)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def DistributedDataParallel(
    module,
    device_ids=None,
    output_device=None,
    dim=0,
    broadcast_buffers=True,
    process_group=None,
    **kwargs,
):
    """``torch.nn.parallel.DistributedDataParallel(module, ...)``; a module on the torchacc device
    gets gradients averaged inside the step's program (``process_group`` must be the whole job)."""
    on_device = any(isinstance(p, LazyTensor) for p in module.parameters())
    if on_device:
        if process_group is not None and process_group is not dist.GroupMember.WORLD:
            raise NotImplementedError(
                "torchacc.nn.parallel.DistributedDataParallel: a module on the torchacc device "
                "averages over the whole job (process_group=None)"
            )
        return _LazyDDP(module, broadcast_buffers)
    return nn.parallel.DistributedDataParallel(
        module,
        device_ids=device_ids,
        output_device=output_device,
        dim=dim,
        broadcast_buffers=broadcast_buffers,
        process_group=process_group,
        **kwargs,
    )
