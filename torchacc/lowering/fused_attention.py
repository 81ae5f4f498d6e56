"""Lowering of fused attention (``torchacc.attention*``): cuDNN flash attention on XLA:GPU, else an
explicit XLA formulation. The choice is made per call, when a step is lowered.

Note [Fused attention: cuDNN or the XLA fallback]
Each ``torchacc.attention`` (and its backward) picks its implementation with :func:`choose`, from
what the lowering knows: the platform the step is compiled for (lowering/target.py), the dtype,
head dims, mask, causality, dropout and whether the mask needs a gradient. cuDNN serves bf16/fp16
with head_dim a multiple of 8 up to 128 (256 on Hopper), equal q/v head dims, no dropout (JAX's
API has none), causal only for L == S (torch's causal mask is top-left aligned), and masks without
a gradient (a mask becomes cuDNN's bias, broadcast to full L x S, which needs even L and S for
training). Anything else, or a call cuDNN refuses while tracing, takes the XLA fallback. Each
choice is counted once per lowering in ``torchacc.metrics``: ``FusedAttentionCudnn`` /
``FusedAttentionXlaFallback:<reason>`` for the forward, ``FusedAttentionBackward...`` for the
backward. ``TORCHACC_FUSED_ATTENTION=xla`` forces the fallback (reason ``disabled``); it is read
when a step is compiled.

The two ops of one attention call see the same arguments, so they pick the same path. On cuDNN the
backward is ``jax.vjp`` of the same cuDNN call: its forward is the identical custom call the
forward op made (``return_residual=True`` puts both in training mode), which XLA's CSE can share;
the forward op's logsumexp output is unused there. The fallback saves only the output and the
float32 logsumexp (B, H, L); the backward recomputes the probabilities from them (flash-attention
style), so no L x S tensor outlives the op. Grouped-query attention is computed grouped (q viewed
as (B, Hkv, G, L, D)), so k and v are never repeated to q's head count.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from torchacc import metrics
from torchacc.lowering import fused_ops as ops
from torchacc.lowering import memory, nn, target
from torchacc.lowering.nn_backward import _sum_to
from torchacc.lowering.registry import register

_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_STATIC = ("dropout_p", "scale")


def choose(platform, dtype, head_dim, v_head_dim, L, S, mask, is_causal, dropout_p, mask_grad):
    """None when cuDNN can serve the call, else the fallback's reason (a short name).

    ``mask`` is None, ``"bool"`` or ``"float"``; the rest are Python values."""
    if os.environ.get("TORCHACC_FUSED_ATTENTION", "auto").lower() == "xla":
        return "disabled"
    if platform != "gpu":
        return "platform"
    if dtype not in _CUDNN_DTYPES:
        return "dtype"
    if head_dim % 8 or head_dim > 256:
        return "head_dim"
    if v_head_dim != head_dim:
        return "v_head_dim"
    if dropout_p:
        return "dropout"
    if is_causal and L != S:
        return "causal_cross"
    if mask is not None and mask_grad:
        return "mask_grad"
    if mask is not None and (L % 2 or S % 2):
        return "mask_odd_length"
    return None


def _choose(q, k, v, mask, is_causal, dropout_p, mask_grad):
    kind = None if mask is None else ("bool" if mask.dtype == jnp.bool_ else "float")
    reason = choose(
        target.platform(),
        q.dtype,
        q.shape[-1],
        v.shape[-1],
        q.shape[-2],
        k.shape[-2],
        kind,
        is_causal,
        dropout_p,
        mask_grad,
    )
    if reason is None and q.shape[-1] > 128 and not _hopper():
        reason = "head_dim"
    return reason


def _hopper():
    try:
        return float(jax.devices("gpu")[0].compute_capability) >= 9.0
    except (RuntimeError, AttributeError, ValueError):
        return False


def _count(prefix, reason):
    metrics.counter_inc(f"{prefix}Cudnn" if reason is None else f"{prefix}XlaFallback:{reason}")


def _scale(head_dim, scale):
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


# -------------------------------------------------------------------------------------------------
# cuDNN (jax.nn.dot_product_attention works in B, T, N, H; torch in B, N, T, H)


def _cudnn_bias(mask, dtype, L, S):
    if mask is None:
        return None
    m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    m = jnp.broadcast_to(m, m.shape[:2] + (L, S))
    big_negative = jnp.asarray(-(2**40) if dtype == jnp.bfloat16 else -(2**14), dtype)
    if m.dtype == jnp.bool_:
        return jnp.where(m, jnp.asarray(0, dtype), big_negative)
    return jnp.maximum(m.astype(dtype), big_negative)  # -inf is not safe in cuDNN's bias


def _cudnn_fn(mask, is_causal, scale, residual):
    def attend(q, k, v):
        bias = _cudnn_bias(mask, q.dtype, q.shape[-2], k.shape[-2])
        t = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        res = jax.nn.dot_product_attention(
            *t,
            bias=bias,
            scale=_scale(q.shape[-1], scale),
            is_causal=is_causal,
            implementation="cudnn",
            return_residual=residual,
        )
        if residual:
            out, lse = res  # lse: (B, L, N)
            return jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse, 1, 2).astype(jnp.float32)
        return jnp.swapaxes(res, 1, 2)

    return attend


_CUDNN_ERRORS = (NotImplementedError, ValueError, RuntimeError, TypeError)


# -------------------------------------------------------------------------------------------------
# the XLA fallback, grouped over kv heads


def _grouped(x, hk):
    """(B, H, L, D) -> (B, Hkv, G, L, D)."""
    return x.reshape(x.shape[:1] + (hk, x.shape[1] // hk) + x.shape[2:])


def _grouped_mask(mask, H, hk):
    m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if m.shape[1] == H:
        return _grouped(m, hk)
    return m.reshape(m.shape[:1] + (1, 1) + m.shape[2:])


def _scores(qg, k, mask, is_causal, scale):
    """Scaled, masked scores (B, Hkv, G, L, S) in float32 (float64 for float64 input)."""
    s = nn.einsum_attn("bkgld,bksd->bkgls", qg, k)
    s = s * jnp.asarray(_scale(qg.shape[-1], scale), s.dtype)
    L, S = s.shape[-2:]
    if is_causal:
        s = jnp.where(jnp.asarray(np.tril(np.ones((L, S), bool))), s, -jnp.inf)
    if mask is not None:
        m = _grouped_mask(mask, qg.shape[1] * qg.shape[2], qg.shape[1])
        s = jnp.where(m, s, -jnp.inf) if m.dtype == jnp.bool_ else s + m.astype(s.dtype)
    return s


def _keep(seed, q, k, dropout_p, hk):
    keep = nn.keep_mask(nn.dropout_key(seed), q.shape[:-1] + (k.shape[-2],), dropout_p)
    return _grouped(keep, hk)


def _xla_forward(q, k, v, mask, is_causal, scale, seed=None, dropout_p=0.0):
    hk = k.shape[1]
    qg = _grouped(q, hk)
    s = _scores(qg, k, mask, is_causal, scale)
    lse = nn.attn_lse(s)
    p = nn.attn_probs(s, lse)
    if dropout_p:
        p = p * _keep(seed, q, k, dropout_p, hk).astype(p.dtype) * (1.0 / (1.0 - dropout_p))
    out = nn.einsum_attn("bkgls,bksd->bkgld", p.astype(v.dtype), v)
    B, H, L = q.shape[:3]
    return out.reshape((B, H, L, v.shape[-1])).astype(q.dtype), lse.reshape((B, H, L))


def _xla_backward(grad, q, k, v, out, lse, seed, mask, is_causal, scale, dropout_p, mask_grad):
    # Note [Backward rules read fenced forward values] (memory.py): p is recomputed, not kept
    q, k = memory.fenced([q, k], [grad])
    hk = k.shape[1]
    qg, dog = _grouped(q, hk), _grouped(grad.astype(q.dtype), hk)
    s = _scores(qg, k, mask, is_causal, scale)
    lse = nn.attn_lse(s) if lse is None else _grouped(lse, hk)
    p = nn.attn_probs(s, lse)
    pd, drop = p, None
    if dropout_p:
        drop = _keep(seed, q, k, dropout_p, hk).astype(p.dtype) * (1.0 / (1.0 - dropout_p))
        pd = p * drop
    dv = nn.einsum_attn("bkgls,bkgld->bksd", pd.astype(v.dtype), dog)
    dp = nn.einsum_attn("bkgld,bksd->bkgls", dog, v)
    if drop is not None:
        dp = dp * drop
    delta = jnp.sum(grad.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, dtype=jnp.float32)
    ds = p * (dp - _grouped(delta, hk)[..., None].astype(p.dtype))
    sc = jnp.asarray(_scale(q.shape[-1], scale), ds.dtype)
    dq = nn.einsum_attn("bkgls,bksd->bkgld", ds.astype(q.dtype), k) * sc
    dk = nn.einsum_attn("bkgls,bkgld->bksd", ds.astype(q.dtype), qg) * sc
    dmask = None
    if mask_grad and mask is not None:
        full = ds.reshape(q.shape[:3] + (k.shape[-2],))
        dmask = _sum_to(full, mask.shape).astype(mask.dtype)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dmask


# -------------------------------------------------------------------------------------------------
# the rules


def _forward(q, k, v, mask, dropout_p, is_causal, scale, mask_grad, seed=None):
    reason = _choose(q, k, v, mask, is_causal, dropout_p, mask_grad)
    if reason is None:
        try:
            out, lse = _cudnn_fn(mask, is_causal, scale, residual=True)(q, k, v)
            _count("FusedAttention", None)
            return out, lse
        except _CUDNN_ERRORS:
            reason = "cudnn_rejected"
    _count("FusedAttention", reason)
    return _xla_forward(q, k, v, mask, is_causal, scale, seed, dropout_p)


@register(ops.attention, static=_STATIC)
def attention(q, k, v, mask, dropout_p, is_causal, scale, mask_grad):
    return _forward(q, k, v, mask, dropout_p, is_causal, scale, mask_grad)


@register(ops.attention_dropout, static=_STATIC, rng=True)
def attention_dropout(q, k, v, mask, dropout_p, is_causal, scale, mask_grad, *, rng):
    seed = jax.random.bits(rng, (), jnp.uint32).astype(jnp.int64)
    out, lse = _forward(q, k, v, mask, dropout_p, is_causal, scale, mask_grad, seed)
    return out, lse, seed


@register(ops.attention_backward, static=_STATIC)
def attention_backward(grad, q, k, v, out, lse, seed, mask, dropout_p, is_causal, scale, mask_grad):
    reason = _choose(q, k, v, mask, is_causal, dropout_p, mask_grad)
    if reason is None:
        try:
            _, vjp = jax.vjp(_cudnn_fn(mask, is_causal, scale, residual=False), q, k, v)
            dq, dk, dv = vjp(grad.astype(q.dtype))
            _count("FusedAttentionBackward", None)
            return dq, dk, dv, None
        except _CUDNN_ERRORS:
            reason, lse = "cudnn_rejected", None  # the forward's lse may be cuDNN's: recompute
    _count("FusedAttentionBackward", reason)
    return _xla_backward(
        grad, q, k, v, out, lse, seed, mask, is_causal, scale, dropout_p, mask_grad
    )
