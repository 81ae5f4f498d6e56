"""Lowering of the fused kernels other than attention: RMSNorm, rotary embedding, SwiGLU and a
cross-entropy that never materialises float32 logits (ops in fused_ops.py).

Each forward and each backward is one op, so XLA sees the whole kernel at once and fuses it; half
inputs compute in float32 inside the fusion and round once to the output dtype.

Note [Chunked cross-entropy]
``torchacc.cross_entropy`` takes the logits in their own dtype (bf16 under autocast: the caller
never makes a float32 copy, which ``F.cross_entropy`` under autocast does) and works on ``chunk``
rows at a time inside a loop: each iteration upcasts one (chunk, vocab) block, takes its
logsumexp, target logit and mean logit, and writes (chunk,) results. The backward writes the
gradient (softmax - smoothed one-hot) * row weight block by block into a buffer of the logits'
dtype. So the largest float32 temporary is chunk x vocab, never rows x vocab. ``chunk=0`` picks
rows so that a block is about 64 MiB of float32. The last block starts at ``rows - chunk`` (it
overlaps the previous one and recomputes the same rows), so no padding copy of the logits is made.
Targets equal to ``ignore_index`` contribute nothing; ``reduction`` 1 (mean) divides by the number
of other targets, as ``F.cross_entropy``. The saved per-row logsumexp is float32 (rows,).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torchacc.lowering import fused_ops as ops
from torchacc.lowering import memory
from torchacc.lowering.dtypes import opmath
from torchacc.lowering.nn_backward import _sum_to
from torchacc.lowering.registry import register


def _f32(x):
    return x.astype(jnp.float32) if x.dtype != jnp.float64 else x


# -------------------------------------------------------------------------------------------------
# RMSNorm over the last dimension: y = x * rsqrt(mean(x^2) + eps) * weight


@register(ops.rms_norm)
def rms_norm(x, weight, eps):
    xf = _f32(x)
    rstd = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps.astype(xf.dtype))
    y = xf * rstd
    if weight is not None:
        y = y * _f32(weight)
    return y.astype(x.dtype), rstd


@register(ops.rms_norm_backward)
def rms_norm_backward(grad, x, weight, rstd, output_mask):
    x, rstd = memory.fenced([x, rstd], [grad])  # Note [Backward rules read fenced forward ...]
    xf, g = _f32(x), _f32(grad)
    rstd = rstd.astype(xf.dtype)
    xhat = xf * rstd
    dx = dw = None
    if output_mask[0]:
        gw = g * _f32(weight) if weight is not None else g
        dx = rstd * (gw - xhat * jnp.mean(gw * xhat, axis=-1, keepdims=True))
        dx = dx.astype(x.dtype)
    if output_mask[1] and weight is not None:
        dw = jnp.sum((g * xhat).reshape(-1, x.shape[-1]), axis=0).astype(weight.dtype)
    return dx, dw


# -------------------------------------------------------------------------------------------------
# rotary embedding, rotate-half convention: y = x * cos + rotate_half(x) * sin with
# rotate_half([x1, x2]) = [-x2, x1]. cos/sin of head_dim/2 mean [cos, cos] / [sin, sin].


def _full(t, d):
    return jnp.concatenate([t, t], axis=-1) if t.shape[-1] != d else t


def _rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def _rotate_half_t(y):
    """The transpose of rotate_half: [y1, y2] -> [y2, -y1]."""
    y1, y2 = jnp.split(y, 2, axis=-1)
    return jnp.concatenate([y2, -y1], axis=-1)


def _half_sum(t, half):
    """A full-head_dim gradient of a head_dim/2 cos/sin: the two halves add up."""
    if not half:
        return t
    a, b = jnp.split(t, 2, axis=-1)
    return a + b


@register(ops.rotary)
def rotary(x, cos, sin):
    xf, d = _f32(x), x.shape[-1]
    y = xf * _full(_f32(cos), d) + _rotate_half(xf) * _full(_f32(sin), d)
    return y.astype(x.dtype)


@register(ops.rotary_backward)
def rotary_backward(grad, x, cos, sin, output_mask):
    g, d = _f32(grad), grad.shape[-1]
    half = cos.shape[-1] != d
    dx = dcos = dsin = None
    if output_mask[0]:
        dx = g * _full(_f32(cos), d) + _rotate_half_t(g * _full(_f32(sin), d))
        dx = dx.astype(grad.dtype)
    if output_mask[1]:
        dcos = _sum_to(_half_sum(g * _f32(x), half), cos.shape).astype(cos.dtype)
    if output_mask[2]:
        dsin = _sum_to(_half_sum(g * _rotate_half(_f32(x)), half), sin.shape).astype(sin.dtype)
    return dx, dcos, dsin


# -------------------------------------------------------------------------------------------------
# SwiGLU: silu(gate) * up


@register(ops.swiglu)
def swiglu(gate, up):
    g = opmath(gate)
    return (jax.nn.silu(g) * opmath(up)).astype(gate.dtype)


@register(ops.swiglu_backward)
def swiglu_backward(grad, gate, up):
    g, a, b = opmath(grad), opmath(gate), opmath(up)
    sig = jax.nn.sigmoid(a)
    silu = a * sig
    d_up = g * silu
    d_gate = g * b * (sig * (1 + a * (1 - sig)))
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


# -------------------------------------------------------------------------------------------------
# cross-entropy (Note [Chunked cross-entropy])

_BLOCK_BYTES = 64 << 20


def _chunk_rows(rows, vocab, chunk):
    if chunk <= 0:
        chunk = max(1, _BLOCK_BYTES // (4 * max(vocab, 1)))
    return min(chunk, max(rows, 1))


def _blocks(rows, chunk, body, init):
    """Run ``body(start, acc) -> acc`` over blocks of ``chunk`` rows (the last one overlapping)."""
    n = -(-rows // chunk)
    if n <= 1:
        return body(0, init)
    return lax.fori_loop(0, n, lambda i, acc: body(jnp.minimum(i * chunk, rows - chunk), acc), init)


def _block(x, start, chunk):
    """Rows [start, start + chunk) of x, in x's dtype."""
    return lax.dynamic_slice_in_dim(x, start, chunk, axis=0)


def _row_stats(block, tgt, label_smoothing):
    """Per row of a (rows, vocab) block: logsumexp, loss before weighting (float32)."""
    x = _f32(block)
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.log(jnp.sum(jnp.exp(x - m), axis=-1)) + m[:, 0]
    picked = jnp.take_along_axis(x, jnp.clip(tgt, 0, x.shape[-1] - 1)[:, None], axis=-1)[:, 0]
    loss = lse - picked
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - jnp.mean(x, axis=-1))
    return lse, loss


def _reduce(losses, valid, reduction):
    if reduction == 0:
        return losses
    total = jnp.sum(losses)
    return total / jnp.sum(valid).astype(total.dtype) if reduction == 1 else total


@register(ops.cross_entropy, static=("label_smoothing",))
def cross_entropy(logits, target, ignore_index, label_smoothing, reduction, chunk):
    vocab = logits.shape[-1]
    x, t = logits.reshape(-1, vocab), target.reshape(-1)
    rows = x.shape[0]
    chunk = _chunk_rows(rows, vocab, chunk)
    fdt = jnp.float64 if logits.dtype == jnp.float64 else jnp.float32

    def body(start, acc):
        lse_all, loss_all = acc
        block = _block(x, start, chunk)
        tgt = lax.dynamic_slice_in_dim(t, start, chunk, axis=0)
        lse, loss = _row_stats(block, tgt, label_smoothing)
        lse_all = lax.dynamic_update_slice_in_dim(lse_all, lse.astype(fdt), start, axis=0)
        loss_all = lax.dynamic_update_slice_in_dim(loss_all, loss.astype(fdt), start, axis=0)
        return lse_all, loss_all

    init = (jnp.zeros((rows,), fdt), jnp.zeros((rows,), fdt))
    lse, losses = _blocks(rows, chunk, body, init)
    valid = t != ignore_index
    losses = jnp.where(valid, losses, 0.0)
    out = _reduce(losses.reshape(target.shape), valid, reduction)
    return out, lse.reshape(target.shape)


@register(ops.cross_entropy_backward, static=("label_smoothing",))
def cross_entropy_backward(
    grad, logits, target, lse, ignore_index, label_smoothing, reduction, chunk
):
    vocab = logits.shape[-1]
    x, t, lse = logits.reshape(-1, vocab), target.reshape(-1), lse.reshape(-1)
    rows = x.shape[0]
    chunk = _chunk_rows(rows, vocab, chunk)
    valid = t != ignore_index
    g = _f32(grad)
    if reduction == 0:
        weight = g.reshape(-1)
    elif reduction == 1:
        weight = jnp.broadcast_to(g / jnp.sum(valid).astype(g.dtype), (rows,))
    else:
        weight = jnp.broadcast_to(g, (rows,))
    weight = jnp.where(valid, weight, 0.0)
    cols = jnp.arange(vocab)

    def body(start, out):
        block = _f32(_block(x, start, chunk))
        tgt = lax.dynamic_slice_in_dim(t, start, chunk, axis=0)[:, None]
        w = lax.dynamic_slice_in_dim(weight, start, chunk, axis=0)[:, None].astype(block.dtype)
        row_lse = lax.dynamic_slice_in_dim(lse, start, chunk, axis=0)[:, None]
        d = jnp.exp(block - row_lse.astype(block.dtype))
        d = d - jnp.where(cols[None, :] == tgt, 1.0 - label_smoothing, 0.0).astype(block.dtype)
        if label_smoothing:
            d = d - label_smoothing / vocab
        return lax.dynamic_update_slice_in_dim(out, (d * w).astype(x.dtype), start, axis=0)

    out = _blocks(rows, chunk, body, jnp.zeros(x.shape, x.dtype))
    return out.reshape(logits.shape)
