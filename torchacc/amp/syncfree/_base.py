"""What the syncfree optimizers share: the on-device skip and state placement.

Note [Skipping a step on the device]
``step(found_inf=t)`` computes every new value (parameter, moments, step count) as usual and then
writes ``torch.where(found_inf > 0, old, new)`` into each tensor, so an overflowing step leaves
parameters and state exactly as they were and does not advance ``step`` -- without the host ever
reading ``found_inf``. The whole thing is recorded into the step's graph like any other op.
"""

from __future__ import annotations

import torch

from torchacc.lazy.tensor import LazyTensor


def check_options(fused):
    if fused:
        raise ValueError("torchacc syncfree optimizers have no fused variant (fused=True)")


def skip_flag(found_inf):
    """``None`` (never skip), a Python bool, or a 0-dim bool tensor on the device."""
    if found_inf is None:
        return None
    if isinstance(found_inf, torch.Tensor):
        return found_inf > 0
    return bool(found_inf > 0)


def commit(target, new, skip):
    """``target <- new`` unless ``skip``; on the device when ``skip`` is a tensor."""
    if skip is None:
        target.copy_(new)
    else:
        target.copy_(torch.where(skip, target, new))


def as_scalar(x):
    """A hyperparameter as a Python number (a CPU tensor is read; a device tensor is kept)."""
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.numel() == 1:
        return x.item()
    return x


# Note [Fused optimizer steps]
# A parameter group whose parameters, gradients and hyperparameters live where the fused kernels
# expect them (torchacc tensors, dense, real; Python or 1-element device hyperparameters) is updated
# by one ``torch._fused_adam_``/``_fused_adamw_``/``_fused_sgd_`` call: the recorder makes that a
# single node for the whole group (torchacc/lowering/optim.py), where the per-parameter path
# records ~15 ops per parameter. ``found_inf`` goes to the fused op, which leaves everything
# unchanged on the device when it is set; the step counts advance by ``1 - (found_inf > 0)`` so a
# skipped step does not count, as before. Other groups keep the per-parameter path.


def fusable(params, lr, hyper, found_inf):
    """Whether a group can take the fused path (Note [Fused optimizer steps]): torchacc tensors,
    a Python or torchacc-tensor learning rate, Python numbers for the other hyperparameters."""
    if not params:
        return False
    for p in params:
        if type(p) is not LazyTensor or p.grad.is_sparse or torch.is_complex(p):
            return False
    if isinstance(lr, torch.Tensor) and type(lr) is not LazyTensor:
        return False
    if any(isinstance(x, torch.Tensor) for x in hyper):
        return False
    return found_inf is None or type(found_inf) is LazyTensor


def advance_steps(steps, found_inf):
    """Add one to every step count, or ``1 - (found_inf > 0)`` when a skip is possible."""
    if found_inf is None:
        torch._foreach_add_(steps, 1.0)
    else:
        # a list: given one 0-dim tensor, torch's binding picks the Scalar overload and reads it
        # on the host
        applied = (found_inf <= 0).to(torch.float32)
        torch._foreach_add_(steps, [applied] * len(steps))


def new_step(param):
    return torch.zeros((), dtype=torch.float32, device=param.device)


class SyncFreeOptimizer(torch.optim.Optimizer):
    """Base: keeps ``state['step']`` a float32 tensor on the parameter's device (also after
    ``load_state_dict``, which would otherwise leave it on the CPU as torch does for non-capturable
    optimizers)."""

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st:
                    step = st["step"]
                    if not isinstance(step, torch.Tensor):
                        step = torch.tensor(float(step))
                    st["step"] = step.to(dtype=torch.float32, device=p.device)
