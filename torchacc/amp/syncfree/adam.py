"""Syncfree Adam/AdamW: ``torch.optim.Adam``/``AdamW`` whose ``step(found_inf=...)`` skips on the
device (see Note [Skipping a step on the device] in _base.py)."""

from __future__ import annotations

import torch

from torchacc.amp.syncfree._base import (
    SyncFreeOptimizer,
    advance_steps,
    as_scalar,
    check_options,
    commit,
    fusable,
    group_steps,
    new_step,
    skip_flag,
    split_steps,
)


class Adam(SyncFreeOptimizer):
    """Same arguments and update as ``torch.optim.Adam`` (amsgrad, maximize, weight_decay,
    decoupled_weight_decay). ``state['step']`` is a float32 device tensor advanced only by applied
    steps; bias corrections are computed from it on the device in float64, as torch computes them
    in Python doubles. ``foreach``/``capturable``/``differentiable`` are accepted and ignored.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        *,
        foreach=None,
        maximize=False,
        capturable=False,
        differentiable=False,
        fused=None,
        decoupled_weight_decay=False,
    ):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        check_options(fused)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("decoupled_weight_decay", False)

    def _init_state(self, p, amsgrad, step=True):
        state = self.state[p]
        if "exp_avg" not in state:
            if step:
                state["step"] = new_step(p)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None, found_inf=None):
        """One Adam update; with ``found_inf`` > 0 (a device tensor) nothing changes."""
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
            beta1, beta2 = (as_scalar(b) for b in group["betas"])
            eps = group["eps"]
            weight_decay = group["weight_decay"]
            amsgrad = group["amsgrad"]
            if self._fused_step(group, lr, beta1, beta2, eps, weight_decay, amsgrad, found_inf):
                continue
            split_steps(self, group)  # Note [One step count per group]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients")
                if torch.is_complex(p):
                    raise RuntimeError("torchacc syncfree Adam does not support complex params")
                state = self._init_state(p, amsgrad)
                self._update(
                    p,
                    state,
                    skip,
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    amsgrad,
                    group["maximize"],
                    group["decoupled_weight_decay"],
                )
        return loss

    def _fused_step(self, group, lr, beta1, beta2, eps, weight_decay, amsgrad, found_inf):
        """The group's update as one fused node (Note [Fused optimizer steps] in _base.py);
        False when the group needs the per-parameter path."""
        params = [p for p in group["params"] if p.grad is not None]
        if not fusable(params, lr, (beta1, beta2, eps, weight_decay), found_inf):
            return False
        states = [self._init_state(p, amsgrad, step=False) for p in params]
        steps = group_steps(self, group, params, states, new_step)  # Note [One step count ...]
        advance_steps(steps, found_inf)
        if len(steps) == 1 and len(params) > 1:
            steps = steps * len(params)  # the fused kernels read the counts, never write them
        fused = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
        fused(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
            steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=amsgrad,
            maximize=group["maximize"],
            found_inf=found_inf,
        )
        return True

    @staticmethod
    def _update(p, state, skip, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled):
        grad = -p.grad if maximize else p.grad
        step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
        step = step_t + 1
        new_p = p
        if weight_decay != 0:
            if decoupled:
                new_p = p.mul(1 - lr * weight_decay)
            else:
                grad = grad.add(p, alpha=weight_decay)
        new_exp_avg = exp_avg.lerp(grad, 1 - beta1)
        new_exp_avg_sq = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
        # torch computes the bias corrections in Python doubles from the step count
        step64 = step.double()
        bias_correction1 = 1 - torch.full_like(step64, beta1).pow(step64)
        bias_correction2 = 1 - torch.full_like(step64, beta2).pow(step64)
        step_size = (lr / bias_correction1).to(p.dtype)
        bias_correction2_sqrt = bias_correction2.sqrt().to(p.dtype)
        if amsgrad:
            max_sq = state["max_exp_avg_sq"]
            new_max_sq = torch.maximum(max_sq, new_exp_avg_sq)
            denom = (new_max_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            commit(max_sq, new_max_sq, skip)
        else:
            denom = (new_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        new_p = new_p - step_size * (new_exp_avg / denom)
        commit(exp_avg, new_exp_avg, skip)
        commit(exp_avg_sq, new_exp_avg_sq, skip)
        commit(step_t, step, skip)
        commit(p, new_p, skip)


class AdamW(Adam):
    """``torch.optim.AdamW`` (decoupled weight decay, default 1e-2), syncfree."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
    ):
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
        )

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
