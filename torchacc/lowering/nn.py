"""Lowering rules for the neural-network op family (forward ops).

Matmuls, convolution, normalization, softmax, losses, embedding, dropout and attention (pooling is
pooling.py's, upsampling resize.py's). Backward ops live in nn_backward.py and reuse the helpers
defined here.

Precision: half inputs (bf16/fp16) of matmuls and convolutions accumulate in float32
(``preferred_element_type``) and round once to the output dtype, like cuBLAS/cuDNN. Norms, softmax
and losses compute in float32 for half inputs (torch's opmath) and the core casts every output to
the dtype PyTorch's meta kernel reports. Traced scalar arguments (eps, momentum, p, ...) arrive as
float64/int64 0-d arrays: they are always cast to the compute dtype before use so nothing is
silently promoted to float64.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchacc.lowering import custom_ops as ops
from torchacc.lowering import memory, precision
from torchacc.lowering.dtypes import jdtype, opmath
from torchacc.lowering.registry import register

aten = torch.ops.aten

_HALF = (jnp.float16, jnp.bfloat16)

# -------------------------------------------------------------------------------------------------
# shared helpers


def acc_dtype(dtype):
    """Accumulation dtype: float32 for half floats, the dtype itself otherwise."""
    return jnp.float32 if dtype in _HALF else dtype


def scalar(value, dtype):
    """A traced (or Python) scalar argument cast to ``dtype``."""
    return jnp.asarray(value).astype(dtype)


# float32 precision of dots and convolutions: Note [float32 precision follows torch]
dot_precision = precision.dot_precision
conv_precision = precision.conv_precision


def dot(a, b, dims):
    """dot_general accumulating in acc_dtype; returns the accumulator (not rounded)."""
    dtype = jnp.result_type(a, b)
    a, b = a.astype(dtype), b.astype(dtype)
    return lax.dot_general(
        a, b, dims, precision=dot_precision(dtype), preferred_element_type=acc_dtype(dtype)
    )


def einsum(spec, a, b):
    """jnp.einsum accumulating in float32 for half inputs (exact 'highest' precision)."""
    dtype = jnp.result_type(a, b)
    return jnp.einsum(
        spec,
        a.astype(dtype),
        b.astype(dtype),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=acc_dtype(dtype),
    )


def reduce_loss(loss, reduction):
    """torch's Reduction enum: 0 none, 1 mean, 2 sum."""
    if reduction == 1:
        return jnp.mean(loss)
    if reduction == 2:
        return jnp.sum(loss)
    return loss


def _tuple(v, n):
    if isinstance(v, int):
        return (v,) * n
    v = tuple(v)
    return v * n if len(v) == 1 else v


# -------------------------------------------------------------------------------------------------
# matmul family


@register(aten.mm.default)
def mm(self, mat2):
    return dot(self, mat2, (((1,), (0,)), ((), ()))).astype(self.dtype)


@register(aten.bmm.default)
def bmm(self, mat2):
    return dot(self, mat2, (((2,), (1,)), ((0,), (0,)))).astype(self.dtype)


@register(aten.mv.default)
def mv(self, vec):
    return dot(self, vec, (((1,), (0,)), ((), ()))).astype(self.dtype)


@register(aten.dot.default)
def dot_(self, tensor):
    return dot(self, tensor, (((0,), (0,)), ((), ()))).astype(self.dtype)


@register(aten.vdot.default)
def vdot(self, other):
    return dot_(jnp.conj(self), other)


def _axpby(acc, inp, alpha, beta, dtype):
    """alpha * acc + beta * inp in the accumulator dtype; beta == 0 ignores inp (nan included)."""
    if alpha != 1:
        acc = acc * alpha
    if beta != 0:
        inp = inp.astype(acc.dtype)
        acc = acc + (inp if beta == 1 else inp * beta)
    return acc.astype(dtype)


@register(aten.addmm.default, static=("beta", "alpha"))
def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    acc = dot(mat1, mat2, (((1,), (0,)), ((), ())))
    return _axpby(acc, self, alpha, beta, mat1.dtype)


@register(ops.linear)
def linear(input, weight, bias=None):
    acc = dot(input, weight, (((input.ndim - 1,), (1,)), ((), ())))
    if bias is not None:
        acc = acc + bias.astype(acc.dtype)
    return acc.astype(jnp.result_type(input, weight))


@register(ops.linear_backward)
def linear_backward(grad_output, input, weight):
    # the weight gradient's dot (float32 on XLA:CPU) starts from the input in the backward, not
    # from a float32 copy made in the forward (Note [Backward rules read fenced forward values])
    (input,) = memory.fenced([input], [grad_output])
    flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
    flat_input = input.reshape(-1, input.shape[-1])
    grad_input = dot(grad_output, weight, (((grad_output.ndim - 1,), (0,)), ((), ())))
    grad_weight = dot(flat_grad, flat_input, (((0,), (0,)), ((), ())))
    grad_bias = jnp.sum(flat_grad.astype(grad_weight.dtype), axis=0)
    dtype = grad_output.dtype
    return grad_input.astype(dtype), grad_weight.astype(dtype), grad_bias.astype(dtype)


@register(aten._addmm_activation.default, static=("beta", "alpha"))
def addmm_activation(self, mat1, mat2, *, beta=1, alpha=1, use_gelu=False):
    acc = dot(mat1, mat2, (((1,), (0,)), ((), ())))
    out = _axpby(acc, self, alpha, beta, acc.dtype)
    # exact gelu as the CPU kernel (CUDA's cublasLt epilogue uses the tanh approximation)
    out = jax.nn.gelu(out, approximate=False) if use_gelu else jnp.maximum(out, 0)
    return out.astype(mat1.dtype)


@register(aten.baddbmm.default, static=("beta", "alpha"))
def baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    acc = dot(batch1, batch2, (((2,), (1,)), ((0,), (0,))))
    return _axpby(acc, self, alpha, beta, batch1.dtype)


@register(aten.addbmm.default, static=("beta", "alpha"))
def addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    acc = dot(batch1, batch2, (((0, 2), (0, 1)), ((), ())))
    return _axpby(acc, self, alpha, beta, batch1.dtype)


@register(aten.addmv.default, static=("beta", "alpha"))
def addmv(self, mat, vec, *, beta=1, alpha=1):
    acc = dot(mat, vec, (((1,), (0,)), ((), ())))
    return _axpby(acc, self, alpha, beta, mat.dtype)


# -------------------------------------------------------------------------------------------------
# convolution


def conv(x, w, stride, padding, dilation, transposed, output_padding, groups, accumulate=True):
    """N-d convolution with torch's convolution() semantics, without bias.

    ``accumulate=True`` returns the float32 accumulator for half inputs; ``False`` keeps the input
    dtype (used by the backward, whose transposed convolutions then stay in the input dtype while
    the backends still accumulate in float32).
    """
    nsp = w.ndim - 2
    stride, padding = _tuple(stride, nsp), _tuple(padding, nsp)
    dilation, output_padding = _tuple(dilation, nsp), _tuple(output_padding, nsp)
    dn = lax.ConvDimensionNumbers(
        tuple(range(nsp + 2)), tuple(range(nsp + 2)), tuple(range(nsp + 2))
    )
    dtype = jnp.result_type(x, w)
    x, w = x.astype(dtype), w.astype(dtype)
    pet = acc_dtype(dtype) if accumulate else None
    if not transposed:
        return lax.conv_general_dilated(
            x,
            w,
            window_strides=stride,
            padding=[(p, p) for p in padding],
            rhs_dilation=dilation,
            dimension_numbers=dn,
            feature_group_count=groups,
            precision=conv_precision(dtype),
            preferred_element_type=pet,
        )
    # Transposed: a forward convolution of the input dilated by `stride`, with the kernel flipped
    # and its in/out channels swapped within each group. weight: (C_in, C_out / groups, *k).
    cin, cout_g, ks = w.shape[0], w.shape[1], w.shape[2:]
    w = w.reshape((groups, cin // groups, cout_g) + ks)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + ks)
    w = jnp.flip(w, axis=tuple(range(2, nsp + 2)))
    pads = [
        (d * (k - 1) - p, d * (k - 1) - p + op)
        for k, p, d, op in zip(ks, padding, dilation, output_padding, strict=True)
    ]
    return lax.conv_general_dilated(
        x,
        w,
        window_strides=(1,) * nsp,
        padding=pads,
        lhs_dilation=stride,
        rhs_dilation=dilation,
        dimension_numbers=dn,
        feature_group_count=groups,
        precision=conv_precision(dtype),
        preferred_element_type=pet,
    )


@register(aten.convolution.default)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    unbatched = input.ndim == weight.ndim - 1
    x = input[None] if unbatched else input
    out = conv(x, weight, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((1, -1) + (1,) * (out.ndim - 2))
    out = out.astype(jnp.result_type(input, weight))
    return out[0] if unbatched else out


@register(ops.cast_convolution)
def cast_convolution(input, weight, bias, dtype, *conv_args):
    """``convolution`` of ``input``, ``weight`` and ``bias`` cast to ``dtype`` (autocast's casts
    folded into one node; the same XLA ops as recording the casts)."""
    target = jdtype(dtype)
    bias = None if bias is None else bias.astype(target)
    return convolution(input.astype(target), weight.astype(target), bias, *conv_args)


@register(aten._convolution.default)
def _convolution(
    input,
    weight,
    bias,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    benchmark=False,
    deterministic=False,
    cudnn_enabled=True,
    allow_tf32=True,
):
    return convolution(
        input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    )


# The *_overrideable convolutions are where torch routes a convolution on an out-of-tree backend
# (torch 2.11 sends PrivateUse1 there; other versions reach aten.convolution). Same arguments as
# convolution (the backward has no bias_sizes); torch has no meta kernel for them, so recording
# gets one here from convolution's own meta.


conv_out_channels = ops.conv_out_channels


def _convolution_overrideable_meta(input, weight, bias, *conv_args):
    return aten.convolution.default(input, weight, bias, *conv_args)


def _convolution_backward_overrideable_meta(grad_output, input, weight, *args):
    *conv_args, output_mask = args
    transposed, groups = conv_args[3], conv_args[5]
    bias_sizes = [conv_out_channels(weight, transposed, groups)]
    return aten.convolution_backward.default(
        grad_output, input, weight, bias_sizes, *conv_args, output_mask
    )


_aten_meta = torch.library.Library("aten", "IMPL")
_aten_meta.impl("convolution_overrideable", _convolution_overrideable_meta, "Meta")
_aten_meta.impl(
    "convolution_backward_overrideable", _convolution_backward_overrideable_meta, "Meta"
)
register(aten.convolution_overrideable.default)(convolution)


# -------------------------------------------------------------------------------------------------
# normalization


def _bcast(v, ndim, axis=1):
    """Reshape a per-channel vector to broadcast against an ndim array along ``axis``."""
    shape = [1] * ndim
    shape[axis] = -1
    return v.reshape(shape)


def _bn_apply(input, weight, bias, mean, invstd):
    x = opmath(input)
    ct = x.dtype
    y = (x - _bcast(mean.astype(ct), x.ndim)) * _bcast(invstd.astype(ct), x.ndim)
    if weight is not None:
        y = y * _bcast(weight.astype(ct), x.ndim)
    if bias is not None:
        y = y + _bcast(bias.astype(ct), x.ndim)
    return y.astype(input.dtype)


def _bn_stat_dtype(input, running):
    if running is not None:
        return jnp.result_type(acc_dtype(input.dtype), running.dtype)
    return acc_dtype(input.dtype)


def batch_norm_train(input, weight, bias, running_mean, running_var, momentum, eps):
    """Training batch norm: (out, save_mean, save_invstd, new_running_mean, new_running_var)."""
    st = _bn_stat_dtype(input, running_mean)
    x = input.astype(st)
    axes = (0,) + tuple(range(2, x.ndim))
    n = math.prod(x.shape[a] for a in axes)
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - _bcast(mean, x.ndim)), axis=axes)
    invstd = lax.rsqrt(var + scalar(eps, st))
    out = _bn_apply(input, weight, bias, mean, invstd)
    new_rm = new_rv = None
    if running_mean is not None:
        mom = scalar(momentum, st)
        unbiased = var * (n / (n - 1) if n > 1 else math.inf)
        new_rm = (mom * mean + (1 - mom) * running_mean.astype(st)).astype(running_mean.dtype)
        new_rv = (mom * unbiased + (1 - mom) * running_var.astype(st)).astype(running_var.dtype)
    return out, mean, invstd, new_rm, new_rv


def batch_norm_eval(input, weight, bias, running_mean, running_var, eps):
    """Inference batch norm. save_mean/save_invstd have the (C,) shape torch's meta kernel gives
    (CPU returns empty ones); the backward in eval mode reads the running stats, not these."""
    st = _bn_stat_dtype(input, running_mean)
    mean = running_mean.astype(st)
    invstd = lax.rsqrt(running_var.astype(st) + scalar(eps, st))
    return _bn_apply(input, weight, bias, mean, invstd), mean, invstd


@register(aten.native_batch_norm.default)
def native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    # NOTE: eager native_batch_norm updates running_mean/var in place although its schema does not
    # say so; the core must record training=True with running stats as
    # _native_batch_norm_legit_functional and write outputs 3 and 4 back.
    if training:
        return batch_norm_train(input, weight, bias, running_mean, running_var, momentum, eps)[:3]
    return batch_norm_eval(input, weight, bias, running_mean, running_var, eps)


@register(aten._native_batch_norm_legit_functional.default)
def native_batch_norm_legit_functional(
    input, weight, bias, running_mean, running_var, training, momentum, eps
):
    if training:
        return batch_norm_train(input, weight, bias, running_mean, running_var, momentum, eps)
    out = batch_norm_eval(input, weight, bias, running_mean, running_var, eps)
    return out + (running_mean, running_var)


@register(aten._native_batch_norm_legit.no_stats)
def native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    return batch_norm_train(input, weight, bias, None, None, momentum, eps)[:3]


@register(aten._native_batch_norm_legit_no_training.default)
def native_batch_norm_legit_no_training(
    input, weight, bias, running_mean, running_var, momentum, eps
):
    return batch_norm_eval(input, weight, bias, running_mean, running_var, eps)


def _reserve():
    return jnp.zeros((0,), jnp.uint8)


@register(aten._batch_norm_with_update_functional.default)
def batch_norm_with_update_functional(
    input, weight, bias, running_mean, running_var, momentum, eps
):
    out, mean, invstd, rm, rv = batch_norm_train(
        input, weight, bias, running_mean, running_var, momentum, eps
    )
    return out, mean, invstd, _reserve(), rm, rv


@register(aten._batch_norm_no_update.default)
def batch_norm_no_update(input, weight, bias, running_mean, running_var, momentum, eps):
    if running_mean is None:
        out = batch_norm_train(input, weight, bias, None, None, momentum, eps)[:3]
    else:
        out = batch_norm_eval(input, weight, bias, running_mean, running_var, eps)
    return out + (_reserve(),)


def layer_norm_stats(x, axes, eps):
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    return mean, lax.rsqrt(var + scalar(eps, x.dtype))


# eps is static: a runtime eps is a slot of its own per layer, which makes every layer's
# normalization kernel distinct (Note [Pieces read at offset arguments] in program/build.py)
@register(aten.native_layer_norm.default, static=("eps",))
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    x = opmath(input)
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean, rstd = layer_norm_stats(x, axes, eps)
    y = (x - mean) * rstd
    if weight is not None:
        y = y * weight.astype(x.dtype)
    if bias is not None:
        y = y + bias.astype(x.dtype)
    return y.astype(input.dtype), mean, rstd


@register(aten.native_group_norm.default)
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = opmath(input).reshape(N, group, -1)
    mean, rstd = layer_norm_stats(x, (2,), eps)
    y = ((x - mean) * rstd).reshape(N, C, -1)
    if weight is not None:
        y = y * weight.astype(y.dtype)[None, :, None]
    if bias is not None:
        y = y + bias.astype(y.dtype)[None, :, None]
    return y.reshape(input.shape).astype(input.dtype), mean[..., 0], rstd[..., 0]


# -------------------------------------------------------------------------------------------------
# softmax


def _softmax_impl(x, dim, log):
    if x.ndim == 0:
        return jnp.zeros_like(x) if log else jnp.ones_like(x)
    m = lax.stop_gradient(jnp.max(x, axis=dim, keepdims=True))
    e = jnp.exp(x - m)
    s = jnp.sum(e, axis=dim, keepdims=True)
    # log: x - (max + log(sum)), as torch's CPU kernel; XLA recomputes x - m inside the sum's
    # fusion instead of keeping a float32 (rows, classes) copy of it alive for the result
    return x - (m + jnp.log(s)) if log else e / s


@register(aten._softmax.default)
def softmax(self, dim, half_to_float):
    out_dtype = jnp.float32 if half_to_float else self.dtype
    return _softmax_impl(opmath(self), dim, False).astype(out_dtype)


@register(aten._log_softmax.default)
def log_softmax(self, dim, half_to_float):
    out_dtype = jnp.float32 if half_to_float else self.dtype
    return _softmax_impl(opmath(self), dim, True).astype(out_dtype)


@register(aten._safe_softmax.default)
def safe_softmax(self, dim, dtype=None):
    x = self if dtype is None else self.astype(jdtype(dtype))
    out = _softmax_impl(opmath(x), dim, False)
    if x.ndim:
        dead = jnp.all(x == -jnp.inf, axis=dim, keepdims=True)
        out = jnp.where(dead, jnp.zeros((), out.dtype), out)
    return out.astype(x.dtype)


# -------------------------------------------------------------------------------------------------
# losses


def nll_pick(self, target, weight, ignore_index):
    """(-self[target] * w, w) per sample, w = weight[target] masked by ignore_index; opmath."""
    x = opmath(self)
    cdim = 1 if x.ndim >= 2 else 0
    valid = target != ignore_index
    t = jnp.where(valid, target, 0)
    picked = jnp.squeeze(jnp.take_along_axis(x, jnp.expand_dims(t, cdim), axis=cdim), cdim)
    w = jnp.ones((), x.dtype) if weight is None else jnp.take(weight.astype(x.dtype), t)
    w = jnp.where(valid, w, jnp.zeros((), x.dtype))
    return -picked * w, jnp.broadcast_to(w, picked.shape)


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    loss, w = nll_pick(self, target, weight, ignore_index)
    total = jnp.sum(w)
    if reduction == 0:
        # the CPU kernel leaves total_weight at 0 for batched 'none' (it is unused by the backward)
        total = total if self.ndim == 1 else jnp.zeros_like(total)
        return loss.astype(self.dtype), total.astype(self.dtype)
    out = jnp.sum(loss)
    if reduction == 1:
        out = out / total
    return out.astype(self.dtype), total.astype(self.dtype)


@register(aten.mse_loss.default)
def mse_loss(self, target, reduction=1):
    d = opmath(self) - opmath(target)
    return reduce_loss(d * d, reduction).astype(self.dtype)


@register(aten.binary_cross_entropy.default)
def binary_cross_entropy(self, target, weight=None, reduction=1):
    x, t = opmath(self), opmath(target).astype(opmath(self).dtype)
    floor = jnp.asarray(-100, x.dtype)
    loss = -(t * jnp.maximum(jnp.log(x), floor) + (1 - t) * jnp.maximum(jnp.log1p(-x), floor))
    if weight is not None:
        loss = loss * weight.astype(x.dtype)
    return reduce_loss(loss, reduction).astype(self.dtype)


@register(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(self, target, weight=None, pos_weight=None, reduction=1):
    x = opmath(self)
    t = target.astype(x.dtype)
    log_sig = jax.nn.log_sigmoid(x)
    if pos_weight is not None:
        log_sig = log_sig * ((pos_weight.astype(x.dtype) - 1) * t + 1)
    loss = (1 - t) * x - log_sig
    if weight is not None:
        loss = loss * weight.astype(x.dtype)
    return reduce_loss(loss, reduction).astype(self.dtype)


@register(aten.smooth_l1_loss.default)
def smooth_l1_loss(self, target, reduction=1, beta=1.0):
    x = opmath(self)
    z = jnp.abs(x - target.astype(x.dtype))
    b = scalar(beta, x.dtype)
    loss = jnp.where(z < b, 0.5 * z * z / jnp.where(b > 0, b, 1), z - 0.5 * b)
    return reduce_loss(loss, reduction).astype(self.dtype)


@register(aten.huber_loss.default)
def huber_loss(self, target, reduction=1, delta=1.0):
    x = opmath(self)
    z = jnp.abs(x - target.astype(x.dtype))
    dl = scalar(delta, x.dtype)
    loss = jnp.where(z < dl, 0.5 * z * z, dl * (z - 0.5 * dl))
    return reduce_loss(loss, reduction).astype(self.dtype)


# -------------------------------------------------------------------------------------------------
# embedding, dropout


@register(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0, mode="clip")


def keep_mask(key, shape, p):
    """Bernoulli(1 - p) keep mask drawn in float32 (p: traced or Python drop probability)."""
    return jax.random.uniform(key, shape, jnp.float32) >= scalar(p, jnp.float32)


@register(aten.native_dropout.default, rng=True)
def native_dropout(input, p, train, *, rng):
    if train is False:
        return input, jnp.ones(input.shape, jnp.bool_)
    x = opmath(input)
    p1m = 1 - scalar(p, jnp.float32)
    keep = jax.random.uniform(rng, input.shape, jnp.float32) < p1m
    scale = jnp.where(p1m == 0, 0.0, 1.0 / jnp.where(p1m == 0, 1.0, p1m)).astype(x.dtype)
    return (x * keep.astype(x.dtype) * scale).astype(input.dtype), keep


# -------------------------------------------------------------------------------------------------
# scaled dot product attention
#
# A plain softmax(Q K^T * scale + mask) V in float32 opmath, written as two dot_generals around
# elementwise code so XLA fuses the softmax. The CPU-flash op's logsumexp is (B, H, L); the
# efficient op's is padded to a multiple of 32 along L. Dropout (efficient op only) draws its keep
# mask from a key made from philox_seed, so the backward regenerates the identical mask.


def _expand_kv(q, kv):
    """Grouped-query attention: repeat kv heads to q's head count."""
    if q.ndim >= 3 and kv.shape[-3] != q.shape[-3]:
        return jnp.repeat(kv, q.shape[-3] // kv.shape[-3], axis=-3)
    return kv


def _reduce_kv(grad, kv):
    if grad.shape[-3] != kv.shape[-3]:
        r = grad.shape[-3] // kv.shape[-3]
        grad = grad.reshape(grad.shape[:-3] + (kv.shape[-3], r) + grad.shape[-2:]).sum(-3)
    return grad


def attn_scale(q, scale):
    if scale is None:
        return jnp.asarray(1.0 / math.sqrt(q.shape[-1]), jnp.float32)
    return scalar(scale, jnp.float32)


def attn_scores(q, k, mask, is_causal, scale):
    """Scaled, masked scores (..., L, S) in float32."""
    s = einsum_attn("...le,...se->...ls", q, _expand_kv(q, k)) * attn_scale(q, scale)
    L, S = s.shape[-2:]
    if is_causal:
        s = jnp.where(jnp.asarray(np.tril(np.ones((L, S), bool))), s, -jnp.inf)
    if mask is not None:
        if mask.dtype == jnp.bool_:
            s = jnp.where(mask, s, -jnp.inf)
        else:
            s = s + mask.astype(s.dtype)
    return s


def einsum_attn(spec, a, b):
    dtype = jnp.result_type(a, b)
    return jnp.einsum(
        spec,
        a.astype(dtype),
        b.astype(dtype),
        precision=dot_precision(dtype),
        preferred_element_type=acc_dtype(dtype),
    )


def attn_lse(s):
    """logsumexp over keys; rows with no allowed key give 0 (as torch's CPU flash kernel), so that
    exp(s - lse) is exactly 0 there."""
    m = jnp.max(s, axis=-1, keepdims=True)
    dead = m == -jnp.inf
    m = jnp.where(dead, 0.0, m)
    lse = jnp.log(jnp.sum(jnp.exp(s - m), axis=-1, keepdims=True)) + m
    return jnp.where(dead, 0.0, lse)[..., 0]


def attn_probs(s, lse):
    return jnp.exp(s - lse.astype(s.dtype)[..., None])


def dropout_key(seed):
    return jax.random.key(seed.astype(jnp.int64))


def attention_forward(q, k, v, mask, is_causal, scale, keep=None, dropout_p=0.0):
    s = attn_scores(q, k, mask, is_causal, scale)
    lse = attn_lse(s)
    p = attn_probs(s, lse)
    if keep is not None:
        p = p * keep.astype(p.dtype) * (1.0 / (1.0 - dropout_p))
    out = einsum_attn("...ls,...se->...le", p.astype(v.dtype), _expand_kv(q, v))
    return out.astype(q.dtype), lse


@register(aten._scaled_dot_product_flash_attention_for_cpu.default, static=("dropout_p",))
def sdpa_flash_cpu(
    query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None
):
    if dropout_p:
        raise NotImplementedError("torchacc: _scaled_dot_product_flash_attention_for_cpu dropout")
    out, lse = attention_forward(query, key, value, attn_mask, is_causal, scale)
    return out, lse


@register(aten._scaled_dot_product_efficient_attention.default, static=("dropout_p",), rng=True)
def sdpa_efficient(
    query,
    key,
    value,
    attn_bias,
    compute_log_sumexp,
    dropout_p=0.0,
    is_causal=False,
    *,
    scale=None,
    rng,
):
    keep = None
    seed = jnp.zeros((), jnp.int64)
    if dropout_p:
        seed = jax.random.bits(rng, (), jnp.uint32).astype(jnp.int64)
        shape = query.shape[:-1] + (key.shape[-2],)
        keep = keep_mask(dropout_key(seed), shape, dropout_p)
    out, lse = attention_forward(query, key, value, attn_bias, is_causal, scale, keep, dropout_p)
    L = query.shape[-2]
    if compute_log_sumexp:
        pad = -L % 32
        lse = jnp.pad(lse, [(0, 0)] * (lse.ndim - 1) + [(0, pad)], constant_values=jnp.inf)
    else:
        lse = jnp.zeros(lse.shape[:-1] + (0,), jnp.float32)
    return out, lse, seed, jnp.zeros((), jnp.int64)
