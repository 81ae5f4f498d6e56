"""Fused optimizer updates: ``_fused_adam``, ``_fused_adamw``, ``_fused_sgd`` (functional forms).

torch.optim's ``fused=True`` path calls the in-place ``_fused_<opt>_`` once per (device, dtype)
group; the recorder records it as one node of the functional twin (whose outputs are the new values
of every list the op mutates) and writes them back. So a whole group's update is one node, however
many parameters it has, instead of ~15 recorded ops per parameter. The syncfree optimizers use the
same ops (torchacc/amp/syncfree).

Semantics follow PyTorch's fused CPU/CUDA kernels:
- ``grad_scale`` (GradScaler): gradients are divided by it first, and the unscaled gradients are
  written back into ``grads`` (the only case in which ``grads`` changes);
- ``found_inf`` > 0: nothing changes at all (parameters, state, gradients), on the device;
- bias corrections and the step size are computed from ``state_steps`` in float64, as the kernels
  do in double, then applied in the parameters' compute type (float32 for half types).

``weight_decay`` (and SGD's ``momentum``) decide the shape of the computation, as in torch's
kernels (``if weight_decay != 0``), so they are static: changing them recompiles. The learning rate
and betas are runtime scalars (schedules never recompile); ``tensor_lr`` overloads take a tensor.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchacc.lowering.registry import register

aten = torch.ops.aten


def _compute_type(dtype):
    """The type the update is computed in (torch's opmath: float32 for half types)."""
    return jnp.float32 if dtype in (jnp.float16, jnp.bfloat16) else dtype


def _scalar(x):
    """A runtime scalar or a 1-element tensor argument as a 0-d float64 array."""
    return jnp.asarray(x).reshape(()).astype(jnp.float64)


def _skip(found_inf):
    return None if found_inf is None else jnp.asarray(found_inf).reshape(()) > 0


def _keep(skip, old, new):
    """``new`` unless the step is skipped; in ``old``'s dtype."""
    new = new.astype(old.dtype)
    return new if skip is None else jnp.where(skip, old, new)


def _unscaled(grad, grad_scale, compute):
    g = grad.astype(compute)
    if grad_scale is not None:
        g = g / jnp.asarray(grad_scale).reshape(()).astype(compute)
    return g


def _adam(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    state_steps,
    *,
    lr,
    beta1,
    beta2,
    weight_decay,
    eps,
    amsgrad,
    maximize,
    grad_scale=None,
    found_inf=None,
    decoupled,
):
    skip = _skip(found_inf)
    lr, beta1, beta2, eps = _scalar(lr), _scalar(beta1), _scalar(beta2), _scalar(eps)
    out_p, out_g, out_m, out_v, out_vmax = [], [], [], [], []
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)):
        compute = _compute_type(p.dtype)
        grad = _unscaled(g, grad_scale, compute)
        step = _scalar(step)
        bias1 = 1.0 - beta1**step
        bias2_sqrt = jnp.sqrt(1.0 - beta2**step)
        step_size = (lr / bias1).astype(compute)
        param = p.astype(compute)
        d = -grad if maximize else grad
        if weight_decay != 0:
            if decoupled:
                param = param - (lr * weight_decay).astype(compute) * param
            else:
                d = d + weight_decay * param
        b1, b2 = beta1.astype(compute), beta2.astype(compute)
        m_new = m.astype(compute) + (1 - b1) * (d - m.astype(compute))
        v_new = b2 * v.astype(compute) + (1 - b2) * d * d
        second = v_new
        if amsgrad:
            vmax_new = jnp.maximum(max_exp_avg_sqs[i].astype(compute), v_new)
            out_vmax.append(_keep(skip, max_exp_avg_sqs[i], vmax_new))
            second = vmax_new
        denom = jnp.sqrt(second) / bias2_sqrt.astype(compute) + eps.astype(compute)
        param = param - step_size * m_new / denom
        out_p.append(_keep(skip, p, param))
        out_g.append(_keep(skip, g, grad) if grad_scale is not None else g)
        out_m.append(_keep(skip, m, m_new))
        out_v.append(_keep(skip, v, v_new))
    if not amsgrad:
        out_vmax = list(max_exp_avg_sqs)
    return out_p, out_g, out_m, out_v, out_vmax


@register(aten._fused_adam, static=("weight_decay",))
def fused_adam(*args, **kwargs):
    return _adam(*args, **kwargs, decoupled=False)


@register(aten._fused_adamw, static=("weight_decay",))
def fused_adamw(*args, **kwargs):
    return _adam(*args, **kwargs, decoupled=True)


@register(aten._fused_sgd, static=("weight_decay", "momentum"))
def fused_sgd(
    params,
    grads,
    momentum_buffer_list,
    *,
    weight_decay,
    momentum,
    lr,
    dampening,
    nesterov,
    maximize,
    is_first_step,
    grad_scale=None,
    found_inf=None,
):
    skip = _skip(found_inf)
    lr, dampening = _scalar(lr), _scalar(dampening)
    out_p, out_g, out_b = [], [], []
    for i, (p, g) in enumerate(zip(params, grads)):
        compute = _compute_type(p.dtype)
        grad = _unscaled(g, grad_scale, compute)
        param = p.astype(compute)
        d = -grad if maximize else grad
        if weight_decay != 0:
            d = d + weight_decay * param
        if momentum != 0:
            old = momentum_buffer_list[i]
            if is_first_step:
                buf = d
            else:
                buf = momentum * old.astype(compute) + (1 - dampening.astype(compute)) * d
            out_b.append(_keep(skip, old, buf))
            d = d + momentum * buf if nesterov else buf
        param = param - lr.astype(compute) * d
        out_p.append(_keep(skip, p, param))
        out_g.append(_keep(skip, g, grad) if grad_scale is not None else g)
    if momentum == 0:
        out_b = list(momentum_buffer_list)
    return out_p, out_g, out_b
