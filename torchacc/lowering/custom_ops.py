"""torchacc's own ops, ``torch.ops.torchacc.*``: schemas and meta kernels.

They exist where recording PyTorch's decomposition of a common layer would cost many dispatched
ops per step (Note [Autograd-level kernels] in torchacc/_autograd_kernels.py), or where ATen's own
functional op returns what one recorded node cannot describe (``amp_unscale``: ATen's twin returns
a list and a tensor). Each has a meta kernel (shapes and dtypes, like any ATen op) and a lowering
(torchacc/lowering/nn.py, torchacc/lowering/amp.py).
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("torchacc", "DEF")
_lib.define("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor")
_lib.define(
    "linear_backward(Tensor grad_output, Tensor input, Tensor weight) -> (Tensor, Tensor, Tensor)"
)
# Convolution under autocast with its casts folded in: ``aten.convolution`` of ``input``, ``weight``
# and ``bias`` cast to ``dtype``; the backward returns the gradients in the argument dtypes (the
# bias gradient in the weight's), all three always (XLA drops the ones no output needs).
_CONV_ARGS = (
    "int[] stride, int[] padding, int[] dilation, bool transposed, int[] output_padding, int groups"
)
_lib.define(
    f"cast_convolution(Tensor input, Tensor weight, Tensor? bias, ScalarType dtype, {_CONV_ARGS})"
    " -> Tensor"
)
_lib.define(
    "cast_convolution_backward(Tensor grad_output, Tensor input, Tensor weight, ScalarType dtype, "
    f"{_CONV_ARGS}) -> (Tensor, Tensor, Tensor)"
)


def _linear_meta(input, weight, bias=None):
    dtypes = [t.dtype for t in (input, weight, bias) if t is not None]
    if len(set(dtypes)) > 1:
        raise RuntimeError(
            f"torchacc.linear: input, weight and bias must have the same dtype, got "
            f"{', '.join(str(d) for d in dtypes)} (as F.linear on CPU/CUDA)"
        )
    return torch.ops.aten.linear.default(input, weight, bias)  # torch's shape checks


def _linear_backward_meta(grad_output, input, weight):
    if grad_output.shape[:-1] != input.shape[:-1] or grad_output.shape[-1] != weight.shape[0]:
        raise RuntimeError(
            f"torchacc.linear_backward: grad_output of shape {tuple(grad_output.shape)} does not "
            f"match input {tuple(input.shape)} and weight {tuple(weight.shape)}"
        )
    return (
        torch.empty(input.shape, dtype=grad_output.dtype, device="meta"),
        torch.empty(weight.shape, dtype=grad_output.dtype, device="meta"),
        torch.empty(weight.shape[:1], dtype=grad_output.dtype, device="meta"),
    )


# torch._amp_foreach_non_finite_check_and_unscale_'s functional form as one flat list: the new
# grads in order, then the new found_inf (torchacc/lazy/mutation.py writes them back)
_lib.define("amp_unscale(Tensor[] grads, Tensor found_inf, Tensor inv_scale) -> Tensor[]")


def _float32_scalar(name, t):
    if t.dtype != torch.float32 or t.numel() != 1:
        raise RuntimeError(
            f"torch._amp_foreach_non_finite_check_and_unscale_: {name} must be a 1-element "
            f"float32 tensor, got {t.dtype} of shape {tuple(t.shape)}"
        )


def _amp_unscale_meta(grads, found_inf, inv_scale):
    _float32_scalar("found_inf", found_inf)
    _float32_scalar("inv_scale", inv_scale)
    for i, g in enumerate(grads):
        if not g.is_floating_point():
            raise RuntimeError(
                f"torch._amp_foreach_non_finite_check_and_unscale_: grads[{i}] is {g.dtype}; "
                "it unscales floating-point gradients only"
            )
    return [torch.empty_like(g) for g in grads] + [torch.empty_like(found_inf)]


def _cast_convolution_meta(input, weight, bias, dtype, *conv_args):
    bias = None if bias is None else bias.to(dtype)
    return torch.ops.aten.convolution.default(input.to(dtype), weight.to(dtype), bias, *conv_args)


def conv_out_channels(weight, transposed, groups):
    """A convolution's output channels (its bias size) from its weight."""
    return weight.shape[1] * groups if transposed else weight.shape[0]


def _cast_convolution_backward_meta(grad_output, input, weight, dtype, *conv_args):
    bias_sizes = [conv_out_channels(weight, conv_args[3], conv_args[5])]
    cast_input, cast_weight = input.to(dtype), weight.to(dtype)
    grads = torch.ops.aten.convolution_backward.default(
        grad_output, cast_input, cast_weight, bias_sizes, *conv_args, [True, True, True]
    )
    return grads[0].to(input.dtype), grads[1].to(weight.dtype), grads[2].to(weight.dtype)


# XLA's optimization barrier (``xm.optimization_barrier_``): the same values back, which XLA may
# not move computations across nor merge with equal ones (torchacc/lowering/memory.py)
_lib.define("optimization_barrier(Tensor[] tensors) -> Tensor[]")
# ``tensors``' values again, as new values computed after ``after`` exist (gradient checkpointing's
# recompute inputs; Note [Checkpointing that saves memory] in torchacc/lazy/checkpoint.py)
_lib.define("checkpoint_fence(Tensor[] tensors, Tensor[] after) -> Tensor[]")


def _optimization_barrier_meta(tensors, after=()):
    return [torch.empty_like(t) for t in tensors]


_lib.impl("optimization_barrier", _optimization_barrier_meta, "Meta")
_lib.impl("checkpoint_fence", _optimization_barrier_meta, "Meta")
_lib.impl("linear", _linear_meta, "Meta")
_lib.impl("cast_convolution", _cast_convolution_meta, "Meta")
_lib.impl("cast_convolution_backward", _cast_convolution_backward_meta, "Meta")
_lib.impl("linear_backward", _linear_backward_meta, "Meta")
_lib.impl("amp_unscale", _amp_unscale_meta, "Meta")

linear = torch.ops.torchacc.linear.default
linear_backward = torch.ops.torchacc.linear_backward.default
cast_convolution = torch.ops.torchacc.cast_convolution.default
cast_convolution_backward = torch.ops.torchacc.cast_convolution_backward.default
amp_unscale = torch.ops.torchacc.amp_unscale.default
optimization_barrier = torch.ops.torchacc.optimization_barrier.default
checkpoint_fence = torch.ops.torchacc.checkpoint_fence.default

# What each op is in ATen's words, for messages (a recompile names ``aten::linear``, not only the
# fused op that recorded it)
ATEN_NAMES = {
    "torchacc::linear": "aten::linear",
    "torchacc::linear_backward": "aten::linear's backward (aten::mm, aten::sum)",
    "torchacc::cast_convolution": "aten::convolution (with autocast's casts)",
    "torchacc::cast_convolution_backward": "aten::convolution_backward (with autocast's casts)",
    "torchacc::amp_unscale": "aten::_amp_foreach_non_finite_check_and_unscale_",
    "torchacc::optimization_barrier": "xm.optimization_barrier_",
    "torchacc::checkpoint_fence": "gradient checkpointing's recompute fence",
}
