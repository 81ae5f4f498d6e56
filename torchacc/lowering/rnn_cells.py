"""Fused RNN cells: ``_thnn_fused_gru_cell`` and its backward, which torch's ``nn.GRU`` calls per
time step on a PrivateUse1 device (it has no CPU kernel to fall back to). Meta kernels too (torch
ships none), registered only where torch has no Meta kernel of its own.

The workspace the forward saves for the backward is ``[r, z, n, hx, hn]`` along the last axis
(the reset, update and new gates, the previous hidden state and the hidden state's n-gate
projection with its bias): five hidden sizes wide, the shape torch's CUDA kernel gives it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchacc.lowering.registry import register

aten = torch.ops.aten
_lib = torch.library.Library("aten", "IMPL")


def _gru_cell_meta(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    b, h = hx.shape
    return hx.new_empty((b, h)), hx.new_empty((b, 5 * h))


def _gru_cell_backward_meta(grad_hy, workspace, has_bias):
    b, h = grad_hy.shape
    bias = (3 * h,) if has_bias else (0,)
    gates = grad_hy.new_empty((b, 3 * h))
    return (
        gates,
        grad_hy.new_empty((b, 3 * h)),
        grad_hy.new_empty((b, h)),
        grad_hy.new_empty(bias),
        grad_hy.new_empty(bias),
    )


for _name, _fn in (
    ("_thnn_fused_gru_cell", _gru_cell_meta),
    ("_thnn_fused_gru_cell_backward", _gru_cell_backward_meta),
):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", "Meta"):
        _lib.impl(_name, _fn, "Meta")


@register(aten._thnn_fused_gru_cell.default)
def gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_gates is not None and hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, iz, i_n = jnp.split(input_gates, 3, axis=1)
    hr, hz, hn = jnp.split(hidden_gates, 3, axis=1)
    r = jax.nn.sigmoid(ir + hr)
    z = jax.nn.sigmoid(iz + hz)
    n = jnp.tanh(i_n + r * hn)
    hy = (1 - z) * n + z * hx
    return hy, jnp.concatenate([r, z, n, hx, hn], axis=1)


@register(aten._thnn_fused_gru_cell_backward.default)
def gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, hn = jnp.split(workspace, 5, axis=1)
    grad_hx = grad_hy * z
    dz = grad_hy * (hx - n) * z * (1 - z)
    dn = grad_hy * (1 - z) * (1 - n * n)
    dr = dn * hn * r * (1 - r)
    grad_input = jnp.concatenate([dr, dz, dn], axis=1)
    grad_hidden = jnp.concatenate([dr, dz, dn * r], axis=1)
    if has_bias:
        bias = (grad_input.sum(0), grad_hidden.sum(0))
    else:
        bias = (jnp.zeros((0,), grad_hy.dtype),) * 2
    return grad_input, grad_hidden, grad_hx, *bias
