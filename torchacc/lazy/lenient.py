"""Inputs torch_xla accepts where eager PyTorch's CPU kernels refuse them, accepted the same way.

torch_xla lowers some ops without the CPU kernel's argument checks, and users' torch_xla scripts
rely on that. torchacc accepts the same inputs and gives eager's answer for the valid values:

- class-index targets given as a floating tensor to ``nll_loss``/``cross_entropy`` (all their ATen
  forms, forward and backward): the target is converted to int64 (exact for class indices)
  before the op is recorded. Eager CPU raises "expected scalar type Long but found Float".

``wrap(func, handler)`` is called by the recorder when it first classifies an op.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

# op -> position of its class-index target argument
_INDEX_TARGETS = {
    aten.nll_loss_forward.default: 1,
    aten.nll_loss2d_forward.default: 1,
    aten.nll_loss_backward.default: 2,
    aten.nll_loss2d_backward.default: 2,
}


def _long_target(handler, pos):
    def lenient(func, args, kwargs):
        target = args[pos] if pos < len(args) else kwargs.get("target")
        if isinstance(target, torch.Tensor) and target.dtype.is_floating_point:
            target = target.to(torch.int64)
            if pos < len(args):
                args = (*args[:pos], target, *args[pos + 1 :])
            else:
                kwargs = {**kwargs, "target": target}
        return handler(func, args, kwargs)

    return lenient


def wrap(func, handler):
    """``handler`` for ``func``, made lenient where torch_xla is (see the module docstring)."""
    pos = _INDEX_TARGETS.get(func)
    return handler if pos is None else _long_target(handler, pos)
