"""Lowering rules for the backward ops of the neural-network family (see nn.py).

Linear ops (convolution, average pooling, upsampling) take ``jax.vjp`` of the forward lowering,
which is exact. Norms, softmax, losses and attention use the closed-form gradients PyTorch's kernels
use, reading the statistics the forward saved (mean/rstd, logsumexp, ...) rather than recomputing
them. Outputs switched off by an ``output_mask`` are returned as None (undefined tensors).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from torchacc.lowering import custom_ops as ops
from torchacc.lowering import memory, nn, pooling, resize
from torchacc.lowering.dtypes import jdtype, opmath
from torchacc.lowering.nn import acc_dtype, aten, scalar
from torchacc.lowering.registry import register

# -------------------------------------------------------------------------------------------------
# convolution


@register(aten.convolution_backward.default)
def convolution_backward(
    grad_output,
    input,
    weight,
    bias_sizes,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
):
    unbatched = input.ndim == weight.ndim - 1
    x = input[None] if unbatched else input
    g = grad_output[None] if unbatched else grad_output
    dtype = jnp.result_type(input, weight)
    x, w, g = x.astype(dtype), weight.astype(dtype), g.astype(dtype)

    # The vjp of the dtype-preserving convolution: half gradients run as half convolutions (the
    # backends accumulate in float32) instead of being upcast to float32 convolutions.
    def f(a, b):
        return nn.conv(a, b, stride, padding, dilation, transposed, output_padding, groups, False)

    gi = gw = gb = None
    if output_mask[0]:
        gi = jax.vjp(lambda a: f(a, w), x)[1](g)[0].astype(input.dtype)
        gi = gi[0] if unbatched else gi
    if output_mask[1]:
        gw = jax.vjp(lambda b: f(x, b), w)[1](g)[0].astype(weight.dtype)
    if output_mask[2]:
        gb = jnp.sum(opmath(g), axis=(0,) + tuple(range(2, g.ndim))).astype(grad_output.dtype)
    return gi, gw, gb


@register(ops.cast_convolution_backward)
def cast_convolution_backward(grad_output, input, weight, dtype, *conv_args):
    """convolution_backward of the casts to ``dtype``, gradients back in the argument dtypes:
    node for node what recording the casts around ``aten.convolution_backward`` computes."""
    target = jdtype(dtype)
    bias_sizes = [nn.conv_out_channels(weight, conv_args[3], conv_args[5])]
    gi, gw, gb = convolution_backward(
        grad_output,
        input.astype(target),
        weight.astype(target),
        bias_sizes,
        *conv_args,
        (True, True, True),
    )
    return gi.astype(input.dtype), gw.astype(weight.dtype), gb.astype(weight.dtype)


@register(aten.convolution_backward_overrideable.default)
def convolution_backward_overrideable(
    grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups, mask
):
    bias_sizes = [nn.conv_out_channels(weight, transposed, groups)]
    args = (stride, padding, dilation, transposed, output_padding, groups, mask)
    return convolution_backward(grad_output, input, weight, bias_sizes, *args)


# -------------------------------------------------------------------------------------------------
# pooling


def _scatter_planes(grad, indices, shape):
    """Scatter-add grad into planes of ``shape`` at flat (h * W + w) ``indices``."""
    planes = math.prod(shape[:-2])
    g = opmath(grad).reshape(planes, -1)
    idx = indices.reshape(planes, -1)
    out = jnp.zeros((planes, shape[-2] * shape[-1]), g.dtype)
    out = out.at[jnp.arange(planes)[:, None], idx].add(g, mode="promise_in_bounds")
    return out.reshape(shape).astype(grad.dtype)


@register(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(
    grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices
):
    # Dense instead of a scatter: for each kernel offset, keep the gradient of the windows whose
    # index points at that offset and route it back through the transpose of the forward's
    # strided window slice (a pad). Fusable and deterministic; sums overlapping windows.
    k, s, p, d = pooling.pool_args(kernel_size, stride, padding, dilation)
    out = grad_output.shape[-2:]
    base, offs = pooling.pool_flat_offsets(k, s, p, d, out, self.shape[-1])
    g = opmath(grad_output)
    zero = jnp.zeros((), g.dtype)
    ct = jnp.stack([jnp.where(indices == jnp.asarray(base + o), g, zero) for o in offs])
    x0 = jnp.zeros(self.shape, g.dtype)
    _, vjp = jax.vjp(lambda x: pooling.pool_windows(x, k, s, p, d, out, 0)[0], x0)
    return vjp(ct)[0].astype(grad_output.dtype)


@register(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _scatter_planes(grad_output, indices, self.shape)


def _linear_vjp(f, like, grad):
    """Transpose of the linear map ``f`` at an input shaped like ``like``, in opmath."""
    x = jnp.zeros(like.shape if hasattr(like, "shape") else like, acc_dtype(grad.dtype))
    return jax.vjp(f, x)[1](opmath(grad))[0].astype(grad.dtype)


@register(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(
    grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    def f(x):
        return pooling.avg_pool2d(
            x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
        )

    return _linear_vjp(f, self, grad_output)


@register(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(grad_output, self):
    return _linear_vjp(
        lambda x: pooling.adaptive_avg_pool2d(x, grad_output.shape[-2:]), self, grad_output
    )


# -------------------------------------------------------------------------------------------------
# normalization


@register(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(
    grad_out,
    input,
    weight,
    running_mean,
    running_var,
    save_mean,
    save_invstd,
    train,
    eps,
    output_mask,
):
    ref = running_mean if running_mean is not None else save_mean
    st = jnp.result_type(acc_dtype(input.dtype), ref.dtype) if ref is not None else jnp.float32
    x, g = input.astype(st), grad_out.astype(st)
    if train or running_mean is None:
        mean, invstd = save_mean.astype(st), save_invstd.astype(st)
    else:
        mean = running_mean.astype(st)
        invstd = lax.rsqrt(running_var.astype(st) + scalar(eps, st))
    axes = (0,) + tuple(range(2, x.ndim))
    n = math.prod(x.shape[a] for a in axes)
    xmu = x - nn._bcast(mean, x.ndim)
    gsum = jnp.sum(g, axis=axes)
    dotp = jnp.sum(g * xmu, axis=axes)
    wdtype = weight.dtype if weight is not None else st
    gi = gw = gb = None
    if output_mask[0]:
        scale = invstd if weight is None else invstd * weight.astype(st)
        if train:
            k = dotp * invstd * invstd / n
            gi = g - nn._bcast(gsum / n, x.ndim) - xmu * nn._bcast(k, x.ndim)
            gi = gi * nn._bcast(scale, x.ndim)
        else:
            gi = g * nn._bcast(scale, x.ndim)
        gi = gi.astype(input.dtype)
    if output_mask[1]:
        gw = (dotp * invstd).astype(wdtype)
    if output_mask[2]:
        gb = gsum.astype(wdtype)
    return gi, gw, gb


@register(aten.batch_norm_backward.default)
def batch_norm_backward(
    grad_out,
    input,
    weight,
    running_mean,
    running_var,
    save_mean,
    save_var,
    update,
    eps,
    output_mask,
    reserve,
):
    # save_var holds the saved inverse standard deviation (as native_batch_norm's save_invstd)
    return native_batch_norm_backward(
        grad_out,
        input,
        weight,
        running_mean,
        running_var,
        save_mean,
        save_var,
        update,
        eps,
        output_mask,
    )


def _norm_input_grad(g, xhat, rstd, axes):
    """rstd * (g - mean(g) - xhat * mean(g * xhat)) over ``axes`` (g already times weight)."""
    return rstd * (
        g
        - jnp.mean(g, axis=axes, keepdims=True)
        - xhat * jnp.mean(g * xhat, axis=axes, keepdims=True)
    )


@register(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(
    grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
):
    input, mean, rstd = memory.fenced([input, mean, rstd], [grad_out])  # Note [Backward ...]
    x = opmath(input)
    ct = x.dtype
    g = grad_out.astype(ct)
    axis = x.ndim - len(normalized_shape)
    axes, batch_axes = tuple(range(axis, x.ndim)), tuple(range(axis))
    rstd = rstd.astype(ct)
    xhat = (x - mean.astype(ct)) * rstd
    gi = gw = gb = None
    if output_mask[0]:
        gw_ = g if weight is None else g * weight.astype(ct)
        gi = _norm_input_grad(gw_, xhat, rstd, axes).astype(input.dtype)
    if output_mask[1] and weight is not None:
        gw = jnp.sum(g * xhat, axis=batch_axes).astype(weight.dtype)
    if output_mask[2] and bias is not None:
        gb = jnp.sum(g, axis=batch_axes).astype(bias.dtype)
    return gi, gw, gb


@register(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    input, mean, rstd = memory.fenced([input, mean, rstd], [grad_out])  # Note [Backward ...]
    x = opmath(input)
    ct = x.dtype
    x = x.reshape(N, group, C // group, -1)
    g = grad_out.astype(ct).reshape(x.shape)
    rstd = rstd.astype(ct)[:, :, None, None]
    xhat = (x - mean.astype(ct)[:, :, None, None]) * rstd
    gi = gw = gb = None
    if output_mask[0]:
        gw_ = g if weight is None else g * weight.astype(ct).reshape(1, group, -1, 1)
        gi = _norm_input_grad(gw_, xhat, rstd, (2, 3)).reshape(input.shape).astype(input.dtype)
    wdtype = weight.dtype if weight is not None else input.dtype
    if output_mask[1]:
        gw = jnp.sum(g * xhat, axis=(0, 3)).reshape(C).astype(wdtype)
    if output_mask[2]:
        gb = jnp.sum(g, axis=(0, 3)).reshape(C).astype(wdtype)
    return gi, gw, gb


# -------------------------------------------------------------------------------------------------
# softmax


@register(aten._softmax_backward_data.default)
def softmax_backward_data(grad_output, output, dim, input_dtype):
    g = opmath(grad_output)
    y = output.astype(g.dtype)
    return (y * (g - jnp.sum(g * y, axis=dim, keepdims=True))).astype(jdtype(input_dtype))


@register(aten._log_softmax_backward_data.default)
def log_softmax_backward_data(grad_output, output, dim, input_dtype):
    g = opmath(grad_output)
    y = output.astype(g.dtype)
    gi = g - jnp.exp(y) * jnp.sum(g, axis=dim, keepdims=True)
    return gi.astype(jdtype(input_dtype))


# -------------------------------------------------------------------------------------------------
# losses


def _loss_norm(self, reduction):
    return 1.0 / self.size if reduction == 1 else 1.0


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    # the dense (rows, classes) gradient is built from the targets only once the log-probabilities
    # exist, not as early as the targets do (Note [Backward rules read fenced forward values])
    target, weight, total_weight = memory.fenced([target, weight, total_weight], [self])
    ct = acc_dtype(self.dtype)
    cdim = 1 if self.ndim >= 2 else 0
    valid = target != ignore_index
    t = jnp.where(valid, target, 0)
    w = jnp.ones((), ct) if weight is None else jnp.take(weight.astype(ct), t)
    w = jnp.where(valid, w, jnp.zeros((), ct))
    coef = -w * grad_output.astype(ct)
    if reduction == 1:
        coef = coef / total_weight.astype(ct)
    hot = jax.nn.one_hot(t, self.shape[cdim], axis=cdim, dtype=ct)
    return (hot * jnp.expand_dims(coef, cdim)).astype(self.dtype)


@register(aten.mse_loss_backward.default)
def mse_loss_backward(grad_output, self, target, reduction):
    x = opmath(self)
    norm = 2.0 * _loss_norm(self, reduction)
    return (norm * (x - target.astype(x.dtype)) * grad_output.astype(x.dtype)).astype(self.dtype)


@register(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=1):
    x = opmath(self)
    t, g = target.astype(x.dtype), grad_output.astype(x.dtype)
    gi = g * (x - t) / jnp.maximum((1 - x) * x, jnp.asarray(1e-12, x.dtype))
    if weight is not None:
        gi = gi * weight.astype(x.dtype)
    return (gi * _loss_norm(self, reduction)).astype(self.dtype)


@register(aten.smooth_l1_loss_backward.default)
def smooth_l1_loss_backward(grad_output, self, target, reduction, beta):
    x = opmath(self)
    d = x - target.astype(x.dtype)
    g = grad_output.astype(x.dtype) * _loss_norm(self, reduction)
    b = scalar(beta, x.dtype)
    inner = d / jnp.where(b > 0, b, 1) * g
    return jnp.where(d <= -b, -g, jnp.where(d >= b, g, inner)).astype(self.dtype)


@register(aten.huber_loss_backward.default)
def huber_loss_backward(grad_output, self, target, reduction, delta):
    x = opmath(self)
    d = x - target.astype(x.dtype)
    g = grad_output.astype(x.dtype) * _loss_norm(self, reduction)
    dl = scalar(delta, x.dtype)
    return jnp.where(d <= -dl, -g * dl, jnp.where(d >= dl, g * dl, d * g)).astype(self.dtype)


# -------------------------------------------------------------------------------------------------
# embedding, dropout


@register(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    ct = acc_dtype(grad_output.dtype)
    idx = indices.reshape(-1)
    g = grad_output.astype(ct).reshape(idx.shape[0], -1)
    g = jnp.where((idx == padding_idx)[:, None], jnp.zeros((), ct), g)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), ct).at[idx].add(1, mode="promise_in_bounds")
        g = g / jnp.take(counts, idx)[:, None]
    out = jnp.zeros((num_weights, g.shape[1]), ct).at[idx].add(g, mode="promise_in_bounds")
    return out.astype(grad_output.dtype)


@register(aten.native_dropout_backward.default)
def native_dropout_backward(grad_output, mask, scale):
    g = opmath(grad_output)
    return (g * mask.astype(g.dtype) * scalar(scale, g.dtype)).astype(grad_output.dtype)


# -------------------------------------------------------------------------------------------------
# scaled dot product attention


def attention_backward(grad_out, q, k, v, out, lse, mask, is_causal, scale, keep=None, p_drop=0.0):
    """Flash-attention style gradients from the saved logsumexp; returns (dq, dk, dv, dscores).
    The forward's values are read through a fence (Note [Backward rules read fenced forward
    values] in memory.py): the probabilities are recomputed here, not kept from the forward."""
    q, k = memory.fenced([q, k], [grad_out])
    s = nn.attn_scores(q, k, mask, is_causal, scale)
    p = nn.attn_probs(s, lse)
    kx, vx = nn._expand_kv(q, k), nn._expand_kv(q, v)
    do = grad_out.astype(q.dtype)
    if keep is not None:
        drop_scale = keep.astype(p.dtype) * (1.0 / (1.0 - p_drop))
        pd = p * drop_scale
    else:
        pd = p
    dv = nn.einsum_attn("...ls,...le->...se", pd.astype(v.dtype), do)
    dp = nn.einsum_attn("...le,...se->...ls", do, vx)
    if keep is not None:
        dp = dp * drop_scale
    delta = jnp.sum(opmath(grad_out).astype(jnp.float32) * out.astype(jnp.float32), -1)
    ds = p * (dp - delta[..., None])
    sc = nn.attn_scale(q, scale)
    dq = nn.einsum_attn("...ls,...se->...le", ds.astype(q.dtype), kx) * sc
    dk = nn.einsum_attn("...ls,...le->...se", ds.astype(q.dtype), q) * sc
    dk, dv = nn._reduce_kv(dk, k), nn._reduce_kv(dv, v)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), ds


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, static=("dropout_p",))
def sdpa_flash_cpu_backward(
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    if dropout_p:
        raise NotImplementedError("torchacc: _scaled_dot_product_flash_attention_for_cpu dropout")
    dq, dk, dv, _ = attention_backward(
        grad_out, query, key, value, out, logsumexp, attn_mask, is_causal, scale
    )
    return dq, dk, dv


def _sum_to(x, shape):
    """Sum a broadcast result back to ``shape``."""
    lead = x.ndim - len(shape)
    x = jnp.sum(x, axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


@register(aten._scaled_dot_product_efficient_attention_backward.default, static=("dropout_p",))
def sdpa_efficient_backward(
    grad_out_,
    query,
    key,
    value,
    attn_bias,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal=False,
    *,
    scale=None,
):
    keep = None
    if dropout_p:
        shape = query.shape[:-1] + (key.shape[-2],)
        keep = nn.keep_mask(nn.dropout_key(philox_seed), shape, dropout_p)
    lse = logsumexp[..., : query.shape[-2]]
    dq, dk, dv, ds = attention_backward(
        grad_out_, query, key, value, out, lse, attn_bias, is_causal, scale, keep, dropout_p
    )
    gb = None
    if grad_input_mask[3] and attn_bias is not None:
        gb = _sum_to(ds, attn_bias.shape).astype(attn_bias.dtype)
    return dq, dk, dv, gb


# -------------------------------------------------------------------------------------------------
# upsampling


@register(aten.upsample_nearest2d_backward.default, static=("scales_h", "scales_w"))
def upsample_nearest2d_backward(grad_output, output_size, input_size, scales_h=None, scales_w=None):
    def f(x):
        return resize.upsample_nearest(x, tuple(output_size), (scales_h, scales_w))

    return _linear_vjp(f, tuple(input_size), grad_output)


@register(aten.upsample_bilinear2d_backward.default, static=("scales_h", "scales_w"))
def upsample_bilinear2d_backward(
    grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None
):
    def f(x):
        return resize.upsample_linear(x, tuple(output_size), align_corners, (scales_h, scales_w))

    return _linear_vjp(f, tuple(input_size), grad_output)
