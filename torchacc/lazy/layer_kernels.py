"""Batch norm, ReLU, and convolution/linear under autocast, as one autograd Function each.

Note [Layer kernels]
Host cost per step is paid per dispatched op, per tensor made and per autograd node; these layers
cost several of each through torch's composites (Note [Autograd-level kernels] in
autograd_kernels.py):
- Training batch norm: the composite runs ``_batch_norm_impl_index`` (an empty reserve tensor
  through the factory kernel), then ``native_batch_norm``, whose running-stat update the recorder
  writes back from two more tensors: ~6 tensors and 3 dispatches per layer. Here one Function
  records ``_native_batch_norm_legit_functional``, writes the new statistics straight into the
  running buffers' storages and returns one tensor; its backward records
  ``native_batch_norm_backward`` once, reading the batch statistics as the forward's Values (no
  tensors are made for them). ``_BatchNorm.forward`` itself is replaced: a training step on
  torchacc tensors skips ``F.batch_norm`` and the dispatcher's trip into this file's Python kernel
  and calls the Function directly, with torch's checks and messages; anything else (CPU tensors,
  eval mode, no tracked stats, cumulative momentum, an active torch function mode) runs torch's
  own forward, so other devices and tracers see no change.
- Convolution and linear under autocast: the autocast kernel casts input, weight and bias with
  ``.to()``, each a dispatched op with its own tensor and autograd node, and each gradient is cast
  back in the backward. The folded kernels run inside one Function: a convolution is one node
  each way with the casts inside it (``torchacc.cast_convolution`` and its backward, the same XLA
  ops); a linear layer records its casts as graph nodes and the backward reads the forward's
  casts instead of recording them again. ``nn.Conv1d/2d/3d``
  and ``nn.Linear`` call them straight from the module under autocast, without the dispatcher's
  trip into autocast's Python kernel (which calls the same functions); anything else runs torch's
  own forward.
- ``nn.ReLU`` on a torchacc tensor that needs a gradient: torch's ``relu``/``relu_`` autograd
  saves the output tensor, and saving a torchacc tensor costs a ``detach`` dispatch and a tensor.
  ``_ReLU`` records ``relu`` (writing it back for ``inplace=True``, with ``mark_dirty``) and its
  backward reads the output's Value; it refuses a backward through an output changed in place
  since, as eager autograd does.

The program XLA sees is node for node the one the composites record, so numerics do not change.
With ``create_graph=True`` the backwards run differentiable ops instead, so double backward works.
Anything else (eval mode, no running stats, tensors that are not torchacc's, e.g. fake tensors
while dynamo traces) takes torch's own path.
"""

from __future__ import annotations

import math
import types
import weakref

import torch

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.lazy.mutation import assign
from torchacc.lazy.record import VRef, direct_apply, fresh, record_values
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
        ctx.save_for_backward(input, weight)
        # the batch statistics are the forward's own values: kept as such, no tensors made
        ctx.stats = (VRef(vals[1], vals[1].desc), VRef(vals[2], vals[2].desc))
        ctx.eps = eps
        return fresh(vals[0])

    @staticmethod
    def backward(ctx, grad):
        input, weight = ctx.saved_tensors
        mask = list(ctx.needs_input_grad[:3])
        mean, invstd = ctx.stats
        if torch.is_grad_enabled():  # create_graph=True: a differentiable op on tensors
            stats = (fresh(mean.value), fresh(invstd.value))
            grads = _bn_backward(grad, input, weight, None, None, *stats, True, ctx.eps, mask)
        else:
            args = (grad, input, weight, None, None, mean, invstd, True, ctx.eps, mask)
            vals = record_values(_bn_backward, args, {})[0]
            grads = [fresh(v) if need else None for v, need in zip(vals, mask)]
        return grads[0], grads[1], grads[2], None, None, None, None


_batch_norm_apply = direct_apply(_BatchNormTrain)


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
    return _batch_norm_train(input, weight, bias, running_mean, running_var, momentum, eps)


def _batch_norm_train(input, weight, bias, running_mean, running_var, momentum, eps):
    if _needs_grad(input, weight, bias):
        return _batch_norm_apply(input, weight, bias, running_mean, running_var, momentum, eps)
    return fresh(_bn_record(input, weight, bias, running_mean, running_var, momentum, eps)[0])


_lib.impl(_batch_norm_op, _batch_norm, "AutogradPrivateUse1")

_add = aten.add.Tensor


def _count_batch(counter):
    """``counter.add_(1)``: the node the dispatcher's in-place path records, minus its dispatch."""
    if type(counter) is not LazyTensor or counter._view is not None or _inference_mode():
        counter.add_(1)
        return
    assign(counter, record_values(_add, (counter, 1), {})[0][0])
    _increment_version(counter)


_inference_mode = torch.is_inference_mode_enabled
_has_torch_function = torch._C._has_torch_function


def _batch_norm_module_fast(self, input):
    """``_BatchNorm.forward`` for a training step on torchacc tensors, skipping ``F.batch_norm``
    and the dispatcher (Note [Layer kernels]); None where torch's own forward must run."""
    running_mean, running_var = self.running_mean, self.running_var
    weight, bias, momentum = self.weight, self.bias, self.momentum
    counter = self.num_batches_tracked
    if (
        type(input) is not LazyTensor
        or not (self.training and self.track_running_stats)
        or type(running_mean) is not LazyTensor
        or type(running_var) is not LazyTensor
        or counter is None
        or momentum is None
        or _has_torch_function((input, running_mean, running_var, weight, bias))
    ):
        return None
    self._check_input_dim(input)
    _count_batch(counter)
    shape = input.shape
    if shape[0] * math.prod(shape[2:]) == 1:  # F.batch_norm's check and message
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {shape}"
        )
    if self.eps <= 0.0:
        raise ValueError(f"batch_norm eps must be positive during training, but got {self.eps}")
    return _batch_norm_train(input, weight, bias, running_mean, running_var, momentum, self.eps)


# --- casts folded into convolution and linear (autocast) -----------------------------------

_to_copy = aten._to_copy.default
_convolution_backward = aten.convolution_backward.default
_FOLDABLE = (torch.float32, torch.float16, torch.bfloat16)


def _cast(t, dtype):
    """``t`` as an argument of dtype ``dtype``: ``t`` itself, or a recorded cast (no tensor)."""
    if t is None or t.dtype == dtype:
        return t
    val = record_values(_to_copy, (t,), {"dtype": dtype})[0][0]
    return VRef(val, val.desc)


def _record_cast(op, dtype, tensors, rest=(), ctx=None):
    """One fresh tensor: ``op`` recorded on ``tensors`` cast to ``dtype``, then ``rest``.

    With ``ctx`` (a Function's), the casts of the first two tensors are kept for its backward,
    which reads the same cast values instead of recording the casts again."""
    casts = [_cast(t, dtype) for t in tensors]
    if ctx is not None:  # None where no cast was needed
        ctx.casts = [c if c is not t else None for c, t in zip(casts[:2], tensors)]
    return fresh(record_values(op, (*casts, *rest), {})[0][0])


def _saved_casts(ctx, input, weight):
    """The forward's casts of ``input`` and ``weight``, or the saved tensors where none was needed
    (read after ``ctx.saved_tensors``, so autograd's in-place check still runs)."""
    cast_input, cast_weight = ctx.casts
    return (
        input if cast_input is None else cast_input,
        weight if cast_weight is None else cast_weight,
    )


def _cast_back(val, dtype):
    if val.desc[2] == dtype:
        return fresh(val)
    return fresh(record_values(_to_copy, (VRef(val, val.desc),), {"dtype": dtype})[0][0])


def _grads_back(vals, originals, needs):
    return [
        _cast_back(v, t.dtype) if need and t is not None else None
        for v, t, need in zip(vals, originals, needs)
    ]


def _record_convolution(input, weight, bias, dtype, params):
    """One fresh tensor: the convolution of the casts to ``dtype``, one node with the casts in."""
    return fresh(
        record_values(ops.cast_convolution, (input, weight, bias, dtype, *params), {})[0][0]
    )


class _CastConvolution(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, dtype, params):
        ctx.save_for_backward(input, weight, bias)
        ctx.dtype, ctx.params = dtype, params
        return _record_convolution(input, weight, bias, dtype, params)

    @staticmethod
    def backward(ctx, grad):
        input, weight, bias = ctx.saved_tensors
        dtype, needs = ctx.dtype, list(ctx.needs_input_grad[:3])
        if torch.is_grad_enabled():  # create_graph=True: differentiable ops
            bias_sizes = None if bias is None else list(bias.shape)
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
        # one node: the casts, convolution_backward and the casts back (the bias gradient comes
        # in the weight's dtype; _grads_back casts it only if the bias has another)
        args = (grad, input, weight, dtype, *ctx.params)
        vals = record_values(ops.cast_convolution_backward, args, {})[0]
        return (*_grads_back(vals, (input, weight, bias), needs), None, None)


class _CastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, dtype):
        ctx.save_for_backward(input, weight, bias)
        ctx.dtype = dtype
        return _record_cast(ops.linear, dtype, (input, weight, bias), ctx=ctx)

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
        vals = record_values(ops.linear_backward, (grad, *_saved_casts(ctx, input, weight)), {})[0]
        return (*_grads_back(vals, (input, weight, bias), needs), None)


_convolution_apply = direct_apply(_CastConvolution)
_linear_apply = direct_apply(_CastLinear)


def _foldable(*tensors):
    return all(t is None or (type(t) is LazyTensor and t.dtype in _FOLDABLE) for t in tensors)


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _fold_convolution(
    dtype, input, weight, bias, stride, padding, dilation, transposed, out_pad, groups
):
    params = (list(stride), list(padding), list(dilation), transposed, list(out_pad), groups)
    if _needs_grad(input, weight, bias):
        return _convolution_apply(input, weight, bias, dtype, params)
    return _record_convolution(input, weight, bias, dtype, params)


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
        return _linear_apply(input, weight, bias, dtype)
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

# --- the modules: no dispatcher trip for a torchacc layer under autocast -------------------------

_AUTOCAST_KEY = torch._C.DispatchKey.AutocastPrivateUse1
_autocast_off = torch._C._dispatch_tls_is_dispatch_key_excluded


def _module_autocast_dtype(input, weight, bias):
    """The dtype autocast would cast this torchacc layer to, or None where the module must run
    torch's own forward (not torchacc tensors, autocast off, a torch function mode active)."""
    if (
        type(input) is not LazyTensor
        or _autocast_off(_AUTOCAST_KEY)  # how autocast itself is switched off
        or _has_torch_function((input, weight, bias))
    ):
        return None
    return torch.get_autocast_dtype(DEVICE_TYPE)


def _conv_module_fast(self, input, weight, bias):
    """``_conv_forward`` of a torchacc convolution under autocast: the folded kernel directly."""
    dtype = _module_autocast_dtype(input, weight, bias)
    if dtype is None or self.padding_mode != "zeros":
        return None
    return _conv_nd(
        dtype, input, weight, bias, self.stride, self.padding, self.dilation, self.groups
    )


def _linear_module_fast(self, input):
    weight, bias = self.weight, self.bias
    dtype = _module_autocast_dtype(input, weight, bias)
    return None if dtype is None else _linear_folded(dtype, input, weight, bias)


# --- ReLU ------------------------------------------------------------------------------------

_relu = aten.relu.default
_threshold_backward = aten.threshold_backward.default


class _ReLU(torch.autograd.Function):
    """``nn.ReLU`` as one Function: its backward reads the forward's output Value. torch's own
    ``relu``/``relu_`` autograd saves the output tensor, which for a torchacc tensor costs a
    ``detach`` dispatch and one more tensor per layer."""

    @staticmethod
    def forward(ctx, input, inplace):
        val = record_values(_relu, (input,), {})[0][0]
        ctx.result = VRef(val, val.desc)
        if inplace:
            assign(input, val)
            ctx.mark_dirty(input)
            out = input
        else:
            out = fresh(val)
        ctx.out = weakref.ref(out)  # its version is taken once apply returns (_relu_module_fast)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = ctx.out()
        if out is not None and out._version != ctx.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [torchacc tensor {list(out.shape)}], which is the output of "
                f"nn.ReLU, is at version {out._version}; expected version {ctx.version} instead."
            )
        if torch.is_grad_enabled():  # create_graph=True: a differentiable op
            return _threshold_backward(grad, fresh(ctx.result.value), 0), None
        return fresh(record_values(_threshold_backward, (grad, ctx.result, 0), {})[0][0]), None


_relu_apply = direct_apply(_ReLU)


def _relu_module_fast(self, input):
    """``nn.ReLU.forward`` for a torchacc tensor that needs a gradient: ``_ReLU``; None (torch's
    forward) without a gradient, for a leaf or a view written in place, under a function mode."""
    inplace = self.inplace
    if (
        type(input) is not LazyTensor
        or not (input.requires_grad and torch.is_grad_enabled())
        or (inplace and (input.is_leaf or input._base is not None or input._view is not None))
        or _has_torch_function((input,))
    ):
        return None
    out = _relu_apply(input, inplace)
    # eager autograd refuses a backward through an output changed in place after it was saved; so
    # does _ReLU.backward, against the version after apply's own bump for an in-place output
    out.grad_fn.version = out._version
    return out


# --- installing the module forwards ----------------------------------------------------------
# Each replaced method tries torchacc's path first and otherwise calls torch's own, kept on the
# class under another name. TorchScript compiles only that call (it skips the branch under
# ``not torch.jit.is_scripting()``), so ``torch.jit.script`` of these modules works as before.


def _forward_trying(fast):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_scripting():
            out = fast(self, input)
            if out is not None:
                return out
        return self._torchacc_torch_forward(input)

    return forward


def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    if not torch.jit.is_scripting():
        out = _conv_module_fast(self, input, weight, bias)
        if out is not None:
            return out
    return self._torchacc_torch_conv_forward(input, weight, bias)


def _install(cls, name, method):
    """``cls.name = method``, torch's own kept as ``cls._torchacc_torch<name>``."""
    torch_method = getattr(cls, name)
    kept = "_torchacc_torch" + (name if name.startswith("_") else "_" + name)
    renamed = types.FunctionType(
        torch_method.__code__,
        torch_method.__globals__,
        kept,
        torch_method.__defaults__,
        torch_method.__closure__,
    )
    renamed.__qualname__ = f"{cls.__qualname__}.{kept}"
    setattr(cls, kept, renamed)
    setattr(cls, name, method)


_install(torch.nn.modules.batchnorm._BatchNorm, "forward", _forward_trying(_batch_norm_module_fast))
for _conv in (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d):
    _install(_conv, "_conv_forward", _conv_forward)
_install(torch.nn.Linear, "forward", _forward_trying(_linear_module_fast))
_install(torch.nn.ReLU, "forward", _forward_trying(_relu_module_fast))
