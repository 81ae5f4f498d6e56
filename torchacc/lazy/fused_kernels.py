"""The fused kernels above autograd on the torchacc device: one op forward, one op backward each.

Note [Fused kernels]
``torchacc_ops`` (attention, RMSNorm, rotary embedding, SwiGLU, cross-entropy) and the routed
``F.scaled_dot_product_attention`` / ``F.rms_norm`` reach these autograd Functions for torchacc
tensors. Each forward records one ``torchacc.*`` op (lowering/fused_ops.py) and each backward one
``torchacc.*_backward`` op, whatever PyTorch's decomposition of the same math would record (SDPA's
math path alone is ~15 ops forward). The backward saves only what its formula needs: attention
its inputs, output and the float32 logsumexp (B, H, L), RMSNorm the float32 rstd (rows, 1),
cross-entropy the logits it was given (in their own dtype) and the float32 logsumexp per row.
Double backward is not supported (``once_differentiable`` says so if it is tried).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from torchacc.lazy.record import direct_apply
from torchacc.lowering import fused_ops as ops

_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# -------------------------------------------------------------------------------------------------
# attention


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, dropout_p, is_causal, scale):
        mask_grad = bool(ctx.needs_input_grad[3])
        args = (dropout_p, is_causal, scale, mask_grad)
        if dropout_p:
            out, lse, seed = ops.attention_dropout(q, k, v, mask, *args)
        else:
            (out, lse), seed = ops.attention(q, k, v, mask, *args), None
        ctx.save_for_backward(q, k, v, out, lse, seed, mask)
        ctx.args = args
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, out, lse, seed, mask = ctx.saved_tensors
        dq, dk, dv, dmask = ops.attention_backward(grad, q, k, v, out, lse, seed, mask, *ctx.args)
        return dq, dk, dv, dmask, None, None, None


_attention_apply = direct_apply(_Attention)


def attention(q, k, v, mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """Attention of torchacc tensors (B, H, L, D), GQA when k/v have fewer heads; ``mask``: bool
    (True = attend) or additive, broadcastable to (B, H, L, S)."""
    dropout_p = float(dropout_p)
    scale = None if scale is None else float(scale)
    if _needs_grad(q, k, v, mask):
        return _attention_apply(q, k, v, mask, dropout_p, bool(is_causal), scale)
    if dropout_p:
        return ops.attention_dropout(q, k, v, mask, dropout_p, bool(is_causal), scale, False)[0]
    return ops.attention(q, k, v, mask, dropout_p, bool(is_causal), scale, False)[0]


# -------------------------------------------------------------------------------------------------
# RMSNorm


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstd = ops.rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        mask = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])]
        dx, dw = ops.rms_norm_backward(grad, x, weight, rstd, mask)
        return dx, dw, None


_rms_norm_apply = direct_apply(_RMSNorm)


def rms_norm(x, weight=None, eps=None):
    """RMSNorm over the last dimension, in x's dtype (as ``F.rms_norm``); ``eps=None``: the
    dtype's machine epsilon, as ``F.rms_norm``."""
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    if _needs_grad(x, weight):
        return _rms_norm_apply(x, weight, float(eps))
    return ops.rms_norm(x, weight, float(eps))[0]


# -------------------------------------------------------------------------------------------------
# rotary embedding


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(
            x if ctx.needs_input_grad[1] or ctx.needs_input_grad[2] else None, cos, sin
        )
        return ops.rotary(x, cos, sin)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, cos, sin = ctx.saved_tensors
        mask = [bool(n) for n in ctx.needs_input_grad]
        return ops.rotary_backward(grad, x, cos, sin, mask)


_rotary_apply = direct_apply(_Rotary)


def rotary(x, cos, sin):
    if _needs_grad(x, cos, sin):
        return _rotary_apply(x, cos, sin)
    return ops.rotary(x, cos, sin)


# -------------------------------------------------------------------------------------------------
# SwiGLU


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return ops.swiglu(gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return ops.swiglu_backward(grad, gate, up)


_swiglu_apply = direct_apply(_SwiGLU)


def swiglu(gate, up):
    if _needs_grad(gate, up):
        return _swiglu_apply(gate, up)
    return ops.swiglu(gate, up)


# -------------------------------------------------------------------------------------------------
# cross-entropy


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, args):
        loss, lse = ops.cross_entropy(logits, target, *args)
        ctx.save_for_backward(logits, target, lse)
        ctx.args = args
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        logits, target, lse = ctx.saved_tensors
        return ops.cross_entropy_backward(grad, logits, target, lse, *ctx.args), None, None


_cross_entropy_apply = direct_apply(_CrossEntropy)


def cross_entropy(
    logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, chunk=0
):
    """Cross-entropy of (..., vocab) logits against (...) class indices, float32 loss; the logits
    stay in their dtype (Note [Chunked cross-entropy] in lowering/fused.py)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"torchacc_ops.cross_entropy: reduction {reduction!r} is not one of "
            f"{sorted(_REDUCTIONS)}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(
            f"torchacc_ops.cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}"
        )
    args = (int(ignore_index), float(label_smoothing), _REDUCTIONS[reduction], int(chunk))
    if _needs_grad(logits):
        return _cross_entropy_apply(logits, target, args)
    return ops.cross_entropy(logits, target, *args)[0]
