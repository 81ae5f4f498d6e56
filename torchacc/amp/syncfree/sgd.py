"""Syncfree SGD: ``torch.optim.SGD`` whose ``step(found_inf=...)`` skips on the device."""

from __future__ import annotations

import torch

from torchacc.amp.syncfree._base import (
    SyncFreeOptimizer,
    advance_steps,
    as_scalar,
    check_options,
    commit,
    fusable,
    new_step,
    skip_flag,
)


class SGD(SyncFreeOptimizer):
    """Same arguments and update as ``torch.optim.SGD`` (momentum, dampening, nesterov,
    weight_decay, maximize). ``foreach``/``differentiable`` are accepted and ignored (the update
    is recorded into the compiled step either way).

    State differs slightly from torch's: with momentum, ``momentum_buffer`` exists from the first
    step (zeros) next to a device ``step`` count; the first applied step sets the buffer to the
    gradient, as torch does, and a skipped first step leaves it uninitialized.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        *,
        maximize=False,
        foreach=None,
        differentiable=False,
        fused=None,
    ):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        check_options(fused)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
        )
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)

    @torch.no_grad()
    def step(self, closure=None, found_inf=None):
        """One SGD update; with ``found_inf`` > 0 (a device tensor) nothing changes."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = skip_flag(found_inf)
        if skip is True:
            return loss
        if skip is False:
            skip = None
        for group in self.param_groups:
            lr = as_scalar(group["lr"])
            momentum = group["momentum"]
            dampening = group["dampening"]
            weight_decay = as_scalar(group["weight_decay"])
            if self._fused_step(group, lr, momentum, dampening, weight_decay, found_inf):
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("torchacc syncfree SGD does not support sparse gradients")
                grad = -p.grad if group["maximize"] else p.grad
                if weight_decay != 0:
                    grad = grad.add(p, alpha=weight_decay)
                if momentum != 0:
                    state = self._momentum_state(p)
                    buf, step = state["momentum_buffer"], state["step"]
                    new_buf = torch.where(
                        step == 0, grad, buf.mul(momentum).add_(grad, alpha=1 - dampening)
                    )
                    grad = grad.add(new_buf, alpha=momentum) if group["nesterov"] else new_buf
                    commit(buf, new_buf, skip)
                    commit(step, step + 1, skip)
                if isinstance(lr, torch.Tensor):
                    new_p = p - lr.to(p.device) * grad
                else:
                    new_p = p.add(grad, alpha=-lr)
                commit(p, new_p, skip)
        return loss

    def _fused_step(self, group, lr, momentum, dampening, weight_decay, found_inf):
        """The group's update as one fused node (Note [Fused optimizer steps] in _base.py). The
        first applied step must set the momentum buffer to the gradient: with dampening 0 that is
        what ``momentum * 0 + grad`` gives from the zero buffer, so only dampening != 0 with
        momentum keeps the per-parameter path (which decides it on the device)."""
        params = [p for p in group["params"] if p.grad is not None]
        hyper = (momentum, dampening, weight_decay)
        if (momentum != 0 and dampening != 0) or not fusable(params, lr, hyper, found_inf):
            return False
        buffers = []
        if momentum != 0:
            steps = []
            for p in params:
                state = self._momentum_state(p)
                buffers.append(state["momentum_buffer"])
                steps.append(state["step"])
            advance_steps(steps, found_inf)
        torch._fused_sgd_(
            params,
            [p.grad for p in params],
            buffers,
            weight_decay=weight_decay,
            momentum=momentum,
            lr=lr,
            dampening=dampening,
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            is_first_step=False,
            found_inf=found_inf,
        )
        return True

    def _momentum_state(self, p):
        """``p``'s state with a momentum buffer (zeros at first) and a device step count."""
        state = self.state[p]
        if state.get("momentum_buffer") is None:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = new_step(p)
        elif "step" not in state:  # a torch.optim.SGD state: buffer already set
            state["step"] = torch.ones((), dtype=torch.float32, device=p.device)
        return state
