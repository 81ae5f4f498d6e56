"""Batch norm, and convolution/linear under autocast, as one autograd Function each.

Note [Layer kernels]
Host cost per step is paid per dispatched op, per tensor made and per autograd node; these layers
cost several of each through torch's composites (Note [Autograd-level kernels] in
autograd_kernels.py):
- Training batch norm: the composite runs ``_batch_norm_impl_index`` (an empty reserve tensor
  through the factory kernel), then ``native_batch_norm``, whose running-stat update the recorder
  writes back from two more tensors: ~6 tensors and 3 dispatches per layer. Here one Function
  records ``_native_batch_norm_legit_functional``, writes the new statistics straight into the
  running buffers' storages and returns one tensor; its backward records
  ``native_batch_norm_backward`` once.
- Convolution and linear under autocast: the autocast kernel casts input, weight and bias with
  ``.to()``, each a dispatched op with its own tensor and autograd node, and each gradient is cast
  back in the backward. The folded kernels record those casts as graph nodes inside one Function.

The program XLA sees is node for node the one the composites record, so numerics do not change.
With ``create_graph=True`` the backwards run differentiable ops instead, so double backward works.
Anything else (eval mode, no running stats, tensors that are not torchacc's, e.g. fake tensors
while dynamo traces) takes torch's own path.
"""

from __future__ import annotations

import torch

from torchacc.lazy.mutation import assign
from torchacc.lazy.record import VRef, fresh, record_values
from torchacc.lazy.tensor import LazyTensor
from torchacc.lowering import custom_ops as ops

_lib = torch.library.Library("aten", "IMPL")
aten = torch.ops.aten
_increment_version = torch.autograd.graph.increment_version

# --- batch norm ----------------------------------------------------------------------------

_batch_norm_op = aten.batch_norm.default
_bn_functional = aten._native_batch_norm_legit_functional.default
_bn_backward = aten.native_batch_norm_backward.default


def _bn_record(input, weight, bias, running_mean, running_var, momentum, eps):
    """Record training batch norm; write the new running stats; return (out, mean, invstd)."""
    vals = record_values(
        _bn_functional, (input, weight, bias, running_mean, running_var, True, momentum, eps), {}
    )[0]
    assign(running_mean, vals[3])
    assign(running_var, vals[4])
    _increment_version(running_mean)
    _increment_version(running_var)
    return vals


class _BatchNormTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, momentum, eps):
        vals = _bn_record(input, weight, bias, running_mean, running_var, momentum, eps)
        ctx.save_for_backward(input, weight, fresh(vals[1]), fresh(vals[2]))
        ctx.eps = eps
        return fresh(vals[0])

    @staticmethod
    def backward(ctx, grad):
        input, weight, mean, invstd = ctx.saved_tensors
        mask = list(ctx.needs_input_grad[:3])
        args = (grad, input, weight, None, None, mean, invstd, True, ctx.eps, mask)
        if torch.is_grad_enabled():  # create_graph=True: a differentiable op
            grads = _bn_backward(*args)
        else:
            vals = record_values(_bn_backward, args, {})[0]
            grads = [fresh(v) if need else None for v, need in zip(vals, mask)]
        return grads[0], grads[1], grads[2], None, None, None, None


def _batch_norm(
    input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled
):
    if not (
        training
        and type(input) is LazyTensor
        and type(running_mean) is LazyTensor
        and type(running_var) is LazyTensor
    ):
        return _batch_norm_op.decompose(
            input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled
        )
    if torch.is_grad_enabled() and (
        input.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    ):
        return _BatchNormTrain.apply(input, weight, bias, running_mean, running_var, momentum, eps)
    return fresh(_bn_record(input, weight, bias, running_mean, running_var, momentum, eps)[0])


_lib.impl(_batch_norm_op, _batch_norm, "AutogradPrivateUse1")

# --- casts folded into convolution and linear (autocast) -----------------------------------

_to_copy = aten._to_copy.default
_convolution = aten.convolution.default
_convolution_backward = aten.convolution_backward.default
_FOLDABLE = (torch.float32, torch.float16, torch.bfloat16)


def _cast(t, dtype):
    """``t`` as an argument of dtype ``dtype``: ``t`` itself, or a recorded cast (no tensor)."""
    if t is None or t.dtype == dtype:
        return t
    val = record_values(_to_copy, (t,), {"dtype": dtype})[0][0]
    return VRef(val, val.desc)


def _record_cast(op, dtype, tensors, rest=()):
    """One fresh tensor: ``op`` recorded on ``tensors`` cast to ``dtype``, then ``rest``."""
    args = (*[_cast(t, dtype) for t in tensors], *rest)
    return fresh(record_values(op, args, {})[0][0])


def _cast_back(val, dtype):
    if val.desc[2] == dtype:
        return fresh(val)
    return fresh(record_values(_to_copy, (VRef(val, val.desc),), {"dtype": dtype})[0][0])


def _grads_back(vals, originals, needs):
    return [
        _cast_back(v, t.dtype) if need and t is not None else None
        for v, t, need in zip(vals, originals, needs)
    ]


class _CastConvolution(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, dtype, params):
        ctx.save_for_backward(input, weight, bias)
        ctx.dtype, ctx.params = dtype, params
        return _record_cast(_convolution, dtype, (input, weight, bias), params)

    @staticmethod
    def backward(ctx, grad):
        input, weight, bias = ctx.saved_tensors
        dtype, needs = ctx.dtype, list(ctx.needs_input_grad[:3])
        bias_sizes = None if bias is None else list(bias.shape)
        if torch.is_grad_enabled():  # create_graph=True: differentiable ops
            grads = _convolution_backward(
                grad, input.to(dtype), weight.to(dtype), bias_sizes, *ctx.params, needs
            )
            return (
                *[
                    g.to(t.dtype) if g is not None else None
                    for g, t in zip(grads, ctx.saved_tensors)
                ],
                None,
                None,
            )
        args = (grad, _cast(input, dtype), _cast(weight, dtype), bias_sizes, *ctx.params, needs)
        vals = record_values(_convolution_backward, args, {})[0]
        return (*_grads_back(vals, (input, weight, bias), needs), None, None)


class _CastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, dtype):
        ctx.save_for_backward(input, weight, bias)
        ctx.dtype = dtype
        return _record_cast(ops.linear, dtype, (input, weight, bias))

    @staticmethod
    def backward(ctx, grad):
        input, weight, bias = ctx.saved_tensors
        dtype, needs = ctx.dtype, ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph=True: differentiable ops
            flat = grad.reshape(-1, grad.shape[-1])
            cast_input = input.to(dtype)
            grads = (
                grad.matmul(weight.to(dtype)) if needs[0] else None,
                flat.t().mm(cast_input.reshape(-1, input.shape[-1])) if needs[1] else None,
                flat.sum(0) if needs[2] else None,
            )
            return (
                *[g if g is None else g.to(t.dtype) for g, t in zip(grads, ctx.saved_tensors)],
                None,
            )
        vals = record_values(
            ops.linear_backward, (grad, _cast(input, dtype), _cast(weight, dtype)), {}
        )[0]
        return (*_grads_back(vals, (input, weight, bias), needs), None)


def _foldable(*tensors):
    return all(t is None or (type(t) is LazyTensor and t.dtype in _FOLDABLE) for t in tensors)


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _fold_convolution(
    dtype, input, weight, bias, stride, padding, dilation, transposed, out_pad, groups
):
    params = (list(stride), list(padding), list(dilation), transposed, list(out_pad), groups)
    if _needs_grad(input, weight, bias):
        return _CastConvolution.apply(input, weight, bias, dtype, params)
    return _record_cast(_convolution, dtype, (input, weight, bias), params)


def _conv_nd(dtype, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    n = weight.dim() - 2

    def expand(v):
        return [v] * n if isinstance(v, int) else v

    if isinstance(padding, str) or not _foldable(input, weight, bias):
        return None
    return _fold_convolution(
        dtype,
        input,
        weight,
        bias,
        expand(stride),
        expand(padding),
        expand(dilation),
        False,
        [0] * n,
        groups,
    )


def _convolution_folded(
    dtype, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
):
    if not _foldable(input, weight, bias):
        return None
    return _fold_convolution(
        dtype, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    )


def _linear_folded(dtype, input, weight, bias=None):
    if not _foldable(input, weight, bias):
        return None
    if _needs_grad(input, weight, bias):
        return _CastLinear.apply(input, weight, bias, dtype)
    return _record_cast(ops.linear, dtype, (input, weight, bias))


# Autocast's lower-precision kernel calls ``FOLDED_CASTS[op](dtype, *args, **kwargs)`` first; a
# ``None`` result means "not foldable here", and it casts with ``.to()`` as usual.
FOLDED_CASTS = {
    aten.conv1d.default: _conv_nd,
    aten.conv2d.default: _conv_nd,
    aten.conv3d.default: _conv_nd,
    aten.convolution.default: _convolution_folded,
    aten.linear.default: _linear_folded,
}
