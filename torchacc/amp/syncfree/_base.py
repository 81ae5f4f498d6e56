"""What the syncfree optimizers share: the on-device skip and state placement.

Note [Skipping a step on the device]
``step(found_inf=t)`` computes every new value (parameter, moments, step count) as usual and then
writes ``torch.where(found_inf > 0, old, new)`` into each tensor, so an overflowing step leaves
parameters and state exactly as they were and does not advance ``step`` -- without the host ever
reading ``found_inf``. The whole thing is recorded into the step's graph like any other op.
"""

from __future__ import annotations

import weakref

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


# Note [One step count per group]
# torch keeps a step count per parameter. In a group whose parameters always step together the
# counts are equal, yet each is one more input and one more output of every step's program, and
# the executable call costs host time per argument (~4 us each: 2 x 161 arguments for ResNet-50).
# So the fused path gives the parameters of a group that take their state together ONE shared
# 0-dim count and advances it once: ``state[p]['step']`` is that same tensor for each of them
# (``state_dict()`` therefore saves one storage). A step whose parameters-with-gradients are not
# exactly the parameters sharing the count first gives every parameter of the group its own copy,
# and the counts go their separate ways from there, as torch's do. ``load_state_dict`` shares them
# again when a group's saved counts are equal. The per-parameter (non-fused) path never sees a
# shared count: it splits first.


class _Holders:
    """Shared step count -> how many parameters hold it, by identity (a tensor-keyed dict would
    compare tensors with ``==``, which reads them on the host)."""

    __slots__ = ("_counts",)

    def __init__(self):
        self._counts = {}

    def __len__(self):
        return len(self._counts)

    def __contains__(self, t):
        entry = self._counts.get(id(t))
        return entry is not None and entry[0]() is t

    def get(self, t):
        entry = self._counts.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def set(self, t, count):
        self._counts = {k: e for k, e in self._counts.items() if e[0]() is not None}
        self._counts[id(t)] = (weakref.ref(t), count)


def _step_holders(opt):
    holders = getattr(opt, "_torchacc_step_holders", None)
    if holders is None:
        holders = opt._torchacc_step_holders = _Holders()
    return holders


def split_steps(opt, group):
    """Give every parameter of ``group`` its own step count (Note [One step count per group])."""
    holders = _step_holders(opt)
    if not len(holders):
        return
    for p in group["params"]:
        st = opt.state.get(p)
        if st and isinstance(st.get("step"), torch.Tensor) and st["step"] in holders:
            st["step"] = st["step"].clone()


def group_steps(opt, group, params, states, make):
    """The step counts to advance for ``params`` (with their ``states``; ``make(p)`` makes a fresh
    count): ``[shared]`` when one count serves exactly them, else one per parameter.
    Note [One step count per group]."""
    holders = _step_holders(opt)
    have = [st.get("step") for st in states]
    first = have[0]
    if first is None and len(params) == len(group["params"]) and all(s is None for s in have):
        shared = make(params[0])  # the whole group takes its state now: one count for all
        holders.set(shared, len(params))
        for st in states:
            st["step"] = shared
        return [shared]
    if first is not None and holders.get(first) == len(params) and all(s is first for s in have):
        return [first]
    split_steps(opt, group)
    for p, st in zip(params, states):
        if st.get("step") is None:
            st["step"] = make(p)
    return [st["step"] for st in states]


def share_loaded_steps(opt):
    """After ``load_state_dict``: one shared count per group whose saved counts are equal Python
    numbers or CPU tensors (reading device tensors here would sync)."""
    holders = _step_holders(opt)
    for group in opt.param_groups:
        states = [opt.state.get(p) for p in group["params"]]
        if not states or any(not st or "step" not in st for st in states):
            continue
        values = []
        for st in states:
            step = st["step"]
            if isinstance(step, torch.Tensor):
                if step.device.type != "cpu" or step.numel() != 1:
                    break
                step = step.item()
            values.append(float(step))
        else:
            if len(set(values)) == 1:
                shared = torch.tensor(values[0], dtype=torch.float32)
                shared = shared.to(group["params"][0].device)
                holders.set(shared, len(states))
                for st in states:
                    st["step"] = shared


class SyncFreeOptimizer(torch.optim.Optimizer):
    """Base: keeps ``state['step']`` a float32 tensor on the parameter's device (also after
    ``load_state_dict``, which would otherwise leave it on the CPU as torch does for non-capturable
    optimizers)."""

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        share_loaded_steps(self)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st:
                    step = st["step"]
                    if not isinstance(step, torch.Tensor):
                        step = torch.tensor(float(step))
                    st["step"] = step.to(dtype=torch.float32, device=p.device)
