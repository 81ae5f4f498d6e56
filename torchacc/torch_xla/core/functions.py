"""``torch_xla.core.functions`` on torchacc: collectives that autograd can differentiate.

The forward passes are ``xm`` collectives (recorded in the step's graph); the backward passes
follow torch_xla's definitions: the gradient of a sum all-reduce is the incoming gradient times
``scale`` (not reduced again); of an all-gather, this replica's slice of the incoming gradient.
"""

from __future__ import annotations

import torch

from torchacc.torch_xla import runtime as xr
from torchacc.torch_xla.core import xla_model as xm


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, reduce_type, scale, groups):
        ctx.reduce_type = reduce_type
        ctx.scale = scale
        output = xm.all_reduce(reduce_type, input, scale=scale, groups=groups)
        ctx.save_for_backward(input, output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, output = ctx.saved_tensors
        grad = grad_output * ctx.scale if ctx.scale != 1.0 else grad_output
        kind = ctx.reduce_type
        if kind == xm.REDUCE_SUM:
            return grad, None, None, None
        if kind == xm.REDUCE_MUL:
            ratio = torch.where(input != 0, output / input, torch.zeros_like(input))
            return grad * ratio, None, None, None
        if kind in (xm.REDUCE_MIN, xm.REDUCE_MAX):
            return torch.where(input == output, grad, torch.zeros_like(grad)), None, None, None
        raise RuntimeError(f"all_reduce backward: unsupported reduce type {kind!r}")


def all_reduce(reduce_type, value, scale=1.0, groups=None):
    """``xm.all_reduce`` of one tensor, differentiable."""
    return AllReduce.apply(value, reduce_type, scale, groups)


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, dim):
        ctx.dim = dim
        ctx.ordinal = xr.global_ordinal()
        ctx.world_size = xr.world_size()
        return xm.all_gather(input, dim=dim)

    @staticmethod
    def backward(ctx, grad_output):
        size = grad_output.size(ctx.dim) // ctx.world_size
        return grad_output.narrow(ctx.dim, ctx.ordinal * size, size).clone(), None


def all_gather(value, dim=0):
    """``xm.all_gather`` along ``dim``, differentiable."""
    return AllGather.apply(value, dim)


class AllReduceSumLayer(torch.autograd.Function):
    """Sum over replicas forward; the gradient is summed over replicas too."""

    @staticmethod
    def forward(ctx, x):
        return xm.all_reduce(xm.REDUCE_SUM, x)

    @staticmethod
    def backward(ctx, grad_output):
        return xm.all_reduce(xm.REDUCE_SUM, grad_output)


def distributed_mm(w, x, split=1):
    """``w @ x`` with ``w`` (N x Ko) sharded along its columns over the replicas and ``x``
    (Ko*world x M) whole on every replica; ``x`` is processed in ``split`` column blocks."""
    world, ordinal = xr.world_size(), xr.global_ordinal()
    if x.size(0) // world != w.size(1):
        raise ValueError(
            f"distributed_mm: x has {x.size(0)} rows; expected {w.size(1)} x {world} replicas"
        )
    if x.size(1) % split:
        raise ValueError(f"distributed_mm: {x.size(1)} columns do not split {split} ways")
    blocks = torch.split(x, x.size(1) // split, dim=1) if split != 1 else (x,)
    results = []
    for block in blocks:
        gathered = all_gather(block, dim=1)
        mine = gathered.narrow(0, ordinal * w.size(1), w.size(1))
        summed = all_reduce(xm.REDUCE_SUM, w @ mine)
        results.append(summed.narrow(1, ordinal * block.size(1), block.size(1)))
    return torch.cat(results, dim=1) if len(results) > 1 else results[0]


class SyncBatchNorm(torch.nn.Module):
    """Batch norm whose batch statistics are averaged over the replicas."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.weight = torch.nn.Parameter(torch.ones(num_features))
        self.bias = torch.nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, batch):
        if not (2 <= batch.ndim <= 5 and batch.shape[1] == self.num_features):
            raise ValueError(
                f"SyncBatchNorm({self.num_features}): input of shape {tuple(batch.shape)}"
            )
        dims = [d for d in range(batch.ndim) if d != 1]
        if self.training:
            scale = 1.0 / xr.world_size()
            mean = AllReduceSumLayer.apply(batch.mean(dim=dims)) * scale
            sqr_mean = AllReduceSumLayer.apply((batch * batch).mean(dim=dims)) * scale
            var = sqr_mean - mean.pow(2)
            with torch.no_grad():
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * var)
        else:
            mean, var = self.running_mean, self.running_var
        shape = [1, -1] + [1] * (batch.ndim - 2)
        norm = (batch - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return norm * self.weight.view(shape) + self.bias.view(shape)

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}"
