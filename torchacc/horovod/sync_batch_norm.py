"""``hvd.SyncBatchNorm``: batch norm whose batch statistics cover every rank's batch.

Works on CPU tensors (gloo), CUDA tensors and torchacc tensors (the reductions are recorded in the
step). Ranks may hold batches of different sizes: the statistics weight each rank by its number of
elements, so they equal ``BatchNorm``'s on the concatenated batch. The mean and the variance take
one reduction each (the variance of deviations from the global mean, not ``E[x^2] - E[x]^2``).
The weight and bias gradients stay local: ``DistributedOptimizer`` reduces them with the others.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from torchacc.horovod import basics, ops


def _sum_over_ranks(t):
    return ops.allreduce(t, op=ops.Sum, name="SyncBatchNorm")


def _shape(x):
    return [1, -1] + [1] * (x.dim() - 2)


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor):
        dims = [0] + list(range(2, x.dim()))
        count = x.new_full((1,), x.numel() // x.shape[1])
        total = _sum_over_ranks(torch.cat([x.sum(dims), count]))
        n = total[-1]
        mean = total[:-1] / n
        centred = x - mean.view(_shape(x))
        var = _sum_over_ranks((centred * centred).sum(dims)) / n
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean.detach() * factor)
                running_var.mul_(1 - factor).add_(var.detach() * (n / (n - 1)) * factor)
        xhat = centred * invstd.view(_shape(x))
        ctx.save_for_backward(xhat, weight, invstd, n)
        y = xhat
        if weight is not None:
            y = y * weight.view(_shape(x))
        if bias is not None:
            y = y + bias.view(_shape(x))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xhat, weight, invstd, n = ctx.saved_tensors
        dims = [0] + list(range(2, xhat.dim()))
        local = torch.cat([grad_y.sum(dims), (grad_y * xhat).sum(dims)])
        sum_dy, sum_dy_xhat = _sum_over_ranks(local).chunk(2)
        scale = invstd if weight is None else invstd * weight
        shape = _shape(xhat)
        mean_dy, mean_dy_xhat = (sum_dy / n).view(shape), (sum_dy_xhat / n).view(shape)
        grad_x = (grad_y - mean_dy - xhat * mean_dy_xhat) * scale.view(shape)
        grad_w = (grad_y * xhat).sum(dims) if ctx.needs_input_grad[1] else None
        grad_b = grad_y.sum(dims) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm*d`` with statistics over all ranks' batches while training."""

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(
                f"torchacc.horovod.SyncBatchNorm: expected at least 2D input, got {input.dim()}D"
            )

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training or not basics.is_initialized() or basics.size() == 1:
            return super().forward(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        track = self.track_running_stats and self.running_mean is not None
        return _SyncBatchNormFn.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if track else None,
            self.running_var if track else None,
            self.eps,
            factor,
        )

    @classmethod
    def convert_sync_batchnorm(cls, module):
        """``module`` with every ``BatchNorm*d`` replaced by a ``SyncBatchNorm`` (same state)."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            out = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
            )
            with torch.no_grad():
                if module.affine:
                    out.weight, out.bias = module.weight, module.bias
                if module.track_running_stats:
                    out.running_mean = module.running_mean
                    out.running_var = module.running_var
                    out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child))
        return out
