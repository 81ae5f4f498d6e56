"""The fused kernels' ops, ``torch.ops.torchacc.*``: schemas and meta kernels (issue 11).

Each kernel of ``torchacc_ops`` is one op forward and one op backward on the torchacc device (Note
[Fused kernels] in torchacc/lazy/fused_kernels.py); their lowerings are in fused.py and
fused_attention.py. A meta kernel gives shapes and dtypes and rejects bad input with a message that
names the op and the shapes, as PyTorch's own kernels do. A backward op's unneeded gradient is
``None`` (like ATen's ``output_mask``), so it is never computed.
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("torchacc", "FRAGMENT")

_ATTN_ARGS = "float dropout_p, bool is_causal, float? scale, bool mask_grad"
_lib.define(
    f"attention(Tensor q, Tensor k, Tensor v, Tensor? mask, {_ATTN_ARGS}) -> (Tensor, Tensor)"
)
_lib.define(
    f"attention_dropout(Tensor q, Tensor k, Tensor v, Tensor? mask, {_ATTN_ARGS}) "
    "-> (Tensor, Tensor, Tensor)"
)
_lib.define(
    "attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    f"Tensor? seed, Tensor? mask, {_ATTN_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)"
)
_lib.define("rms_norm(Tensor x, Tensor? weight, float eps) -> (Tensor, Tensor)")
_lib.define(
    "rms_norm_backward(Tensor grad, Tensor x, Tensor? weight, Tensor rstd, bool[2] output_mask) "
    "-> (Tensor, Tensor)"
)
_lib.define("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor")
_lib.define(
    "rotary_backward(Tensor grad, Tensor? x, Tensor cos, Tensor sin, bool[3] output_mask) "
    "-> (Tensor, Tensor, Tensor)"
)
_lib.define("swiglu(Tensor gate, Tensor up) -> Tensor")
_lib.define("swiglu_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)")
_CE_ARGS = "int ignore_index, float label_smoothing, int reduction, int chunk"
_lib.define(f"cross_entropy(Tensor logits, Tensor target, {_CE_ARGS}) -> (Tensor, Tensor)")
_lib.define(
    f"cross_entropy_backward(Tensor grad, Tensor logits, Tensor target, Tensor lse, {_CE_ARGS}) "
    "-> Tensor"
)

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _empty(shape, dtype):
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _like(t):
    """An output shaped and laid out like ``t`` (strides kept when t is dense), so a caller's
    transpose/view back to its layout needs no copy, as after PyTorch's own kernels."""
    return torch.empty_like(t, device="meta")


def _bhld(shape, dtype):
    """(B, H, L, D) stored as (B, L, H, D), the layout of PyTorch's SDPA outputs and gradients:
    ``y.transpose(1, 2).reshape(B, L, H * D)`` is then a view."""
    b, h, n, d = shape
    return torch.empty((b, n, h, d), dtype=dtype, device="meta").transpose(1, 2)


def _shapes(**tensors):
    return ", ".join(f"{k} {tuple(t.shape)}" for k, t in tensors.items() if t is not None)


def _fail(op, problem, **tensors):
    raise RuntimeError(f"torchacc.{op}: {problem} (got {_shapes(**tensors)})")


# -------------------------------------------------------------------------------------------------
# attention


def check_attention(q, k, v, mask):
    """Shape/dtype rules of torchacc_ops.flash_attention (q: B,Hq,L,D; k, v: B,Hkv,S,D(v))."""
    t = dict(q=q, k=k, v=v, mask=mask)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        _fail("attention", "q, k and v must be 4-d (batch, heads, seq, head_dim)", **t)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in FLOATS:
        raise RuntimeError(
            f"torchacc.attention: q, k and v must have one floating dtype, got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    B, H, L, D = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        _fail("attention", "k and v must share batch, heads and length with each other and q", **t)
    if k.shape[3] != D:
        _fail("attention", "q and k must have the same head_dim", **t)
    if k.shape[1] == 0 or H % k.shape[1]:
        _fail("attention", "q's heads must be a multiple of k/v's heads (GQA/MQA)", **t)
    if mask is not None:
        if mask.dtype != torch.bool and mask.dtype not in FLOATS:
            raise RuntimeError(
                f"torchacc.attention: mask must be bool (True = attend) or an additive float "
                f"mask, got {mask.dtype}"
            )
        full = (B, H, L, k.shape[2])
        shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
        if mask.dim() > 4 or any(m not in (1, n) for m, n in zip(shape, full)):
            _fail("attention", f"mask must broadcast to (batch, heads, L, S) = {full}", **t)


def _attention_meta(q, k, v, mask, dropout_p, is_causal, scale, mask_grad):
    check_attention(q, k, v, mask)
    if not 0.0 <= dropout_p < 1.0:
        raise RuntimeError(f"torchacc.attention: dropout_p must be in [0, 1), got {dropout_p}")
    out = _bhld(q.shape[:3] + v.shape[3:], q.dtype)
    return out, _empty(q.shape[:3], torch.float32)


def _attention_dropout_meta(q, k, v, mask, dropout_p, is_causal, scale, mask_grad):
    out, lse = _attention_meta(q, k, v, mask, dropout_p, is_causal, scale, mask_grad)
    return out, lse, _empty((), torch.int64)


def _attention_backward_meta(
    grad, q, k, v, out, lse, seed, mask, dropout_p, is_causal, scale, mask_grad
):
    if grad.shape != out.shape:
        _fail("attention_backward", "grad must have the output's shape", grad=grad, out=out)
    dmask = _like(mask) if mask_grad and mask is not None else None
    return _bhld(q.shape, q.dtype), _bhld(k.shape, k.dtype), _bhld(v.shape, v.dtype), dmask


# -------------------------------------------------------------------------------------------------
# RMSNorm, rotary embedding, SwiGLU


def _check_float(op, **tensors):
    for name, t in tensors.items():
        if t is not None and t.dtype not in FLOATS:
            raise RuntimeError(f"torchacc.{op}: {name} must be floating point, got {t.dtype}")


def _rms_norm_meta(x, weight, eps):
    _check_float("rms_norm", x=x, weight=weight)
    if x.dim() == 0 or (weight is not None and tuple(weight.shape) != tuple(x.shape[-1:])):
        _fail("rms_norm", "weight must be 1-d of x's last dimension", x=x, weight=weight)
    return _like(x), _empty(x.shape[:-1] + (1,), torch.float32)


def _rms_norm_backward_meta(grad, x, weight, rstd, output_mask):
    dx = _like(x) if output_mask[0] else None
    dw = _like(weight) if output_mask[1] and weight is not None else None
    return dx, dw


def check_rotary(x, cos, sin):
    _check_float("rotary", x=x, cos=cos, sin=sin)
    t = dict(x=x, cos=cos, sin=sin)
    d = x.shape[-1] if x.dim() else 0
    if d % 2 or cos.shape != sin.shape or cos.dim() == 0 or cos.shape[-1] not in (d, d // 2):
        _fail(
            "rotary",
            "x's last dim must be even; cos and sin share a shape whose last dim is "
            "head_dim or head_dim/2",
            **t,
        )
    try:
        torch.broadcast_shapes(tuple(x.shape[:-1]), tuple(cos.shape[:-1]))
    except RuntimeError:
        _fail("rotary", "cos/sin must broadcast against x's leading dimensions", **t)
    if torch.broadcast_shapes(tuple(x.shape[:-1]), tuple(cos.shape[:-1])) != x.shape[:-1]:
        _fail("rotary", "cos/sin must not broadcast x to a larger shape", **t)


def _rotary_meta(x, cos, sin):
    check_rotary(x, cos, sin)
    return _like(x)


def _rotary_backward_meta(grad, x, cos, sin, output_mask):
    dx = _like(grad) if output_mask[0] else None
    dcos = _like(cos) if output_mask[1] else None
    dsin = _like(sin) if output_mask[2] else None
    return dx, dcos, dsin


def _swiglu_meta(gate, up):
    _check_float("swiglu", gate=gate, up=up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise RuntimeError(
            f"torchacc.swiglu: gate and up must have one shape and dtype, got "
            f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}"
        )
    return _like(gate)


def _swiglu_backward_meta(grad, gate, up):
    return _like(gate), _like(up)


# -------------------------------------------------------------------------------------------------
# cross-entropy


def check_cross_entropy(logits, target, reduction):
    _check_float("cross_entropy", logits=logits)
    if logits.dim() == 0 or tuple(target.shape) != tuple(logits.shape[:-1]):
        _fail(
            "cross_entropy",
            "logits (..., vocab) and target (...) must agree",
            logits=logits,
            target=target,
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise RuntimeError(
            f"torchacc.cross_entropy: target must be int64 class indices, got {target.dtype}"
        )
    if reduction not in (0, 1, 2):
        raise RuntimeError(f"torchacc.cross_entropy: reduction {reduction} is not 0/1/2")


def _cross_entropy_meta(logits, target, ignore_index, label_smoothing, reduction, chunk):
    check_cross_entropy(logits, target, reduction)
    loss_shape = target.shape if reduction == 0 else ()
    return _empty(loss_shape, torch.float32), _empty(target.shape, torch.float32)


def _cross_entropy_backward_meta(grad, logits, target, lse, *args):
    return _like(logits)


for _name, _fn in [
    ("attention", _attention_meta),
    ("attention_dropout", _attention_dropout_meta),
    ("attention_backward", _attention_backward_meta),
    ("rms_norm", _rms_norm_meta),
    ("rms_norm_backward", _rms_norm_backward_meta),
    ("rotary", _rotary_meta),
    ("rotary_backward", _rotary_backward_meta),
    ("swiglu", _swiglu_meta),
    ("swiglu_backward", _swiglu_backward_meta),
    ("cross_entropy", _cross_entropy_meta),
    ("cross_entropy_backward", _cross_entropy_backward_meta),
]:
    _lib.impl(_name, _fn, "Meta")

_ns = torch.ops.torchacc
attention = _ns.attention.default
attention_dropout = _ns.attention_dropout.default
attention_backward = _ns.attention_backward.default
rms_norm = _ns.rms_norm.default
rms_norm_backward = _ns.rms_norm_backward.default
rotary = _ns.rotary.default
rotary_backward = _ns.rotary_backward.default
swiglu = _ns.swiglu.default
swiglu_backward = _ns.swiglu_backward.default
cross_entropy = _ns.cross_entropy.default
cross_entropy_backward = _ns.cross_entropy_backward.default
