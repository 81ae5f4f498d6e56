"""The functional API: each kernel picks the torchacc path or the eager one from its inputs' device.

On the torchacc device every call is one recorded op forward and one backward (Note [Fused
kernels] in torchacc/lazy/fused_kernels.py). On CPU/CUDA tensors the same call runs PyTorch's
fused kernels where there are some (SDPA, ``F.rms_norm``, ``F.cross_entropy``) or a plain torch
formulation with the same semantics.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

__all__ = [
    "flash_attention",
    "rms_norm",
    "apply_rotary_emb",
    "rotary_cos_sin",
    "swiglu",
    "cross_entropy",
]


def _on_torchacc(t: torch.Tensor) -> bool:
    """A tensor of torchacc's device, which ``python -m torchacc.run_torch_xla`` names ``xla``
    (Note [The device's name] in torchacc/lazy/device.py); torchacc is not imported here."""
    kind = t.device.type
    if kind == "torchacc":
        return True
    lazy = sys.modules.get("torchacc.lazy.device") if kind == "xla" else None
    return lazy is not None and lazy.DEVICE_TYPE == "xla"


def _kernels():
    from torchacc.lazy import (
        fused_kernels,
    )  # only reached with torchacc tensors: torchacc is loaded

    return fused_kernels


def _check_attention(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"torchacc_ops.flash_attention: q, k, v must be 4-d (batch, heads, seq, head_dim), "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"torchacc_ops.flash_attention: q's heads ({q.shape[1]}) must be a multiple of k's "
            f"and v's ({k.shape[1]}, {v.shape[1]}) (GQA/MQA)"
        )


def _autocast(tensors, device_type):
    """What autocast does to SDPA's inputs: floating tensors to the autocast dtype."""
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return [t.to(dtype) if t.is_floating_point() else t for t in tensors]


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q (B, Hq, L, D), k/v (B, Hkv, S, D): Hkv < Hq is
    grouped-query (Hkv = 1: multi-query) attention. ``attn_mask``: bool (True = attend) or
    additive, broadcastable to (B, Hq, L, S); ``causal`` may be combined with it (top-left
    aligned, as SDPA's). ``scale`` defaults to 1/sqrt(D). Under autocast q, k, v are cast to the
    autocast dtype, as ``F.scaled_dot_product_attention`` is.

    Packed sequences (padding-free SFT batches): ``cu_seqlens`` (n + 1 cumulative starts
    ``[0, l1, l1 + l2, ..., L]``, the same for every row) or ``position_ids`` (B, L) restarting
    at 0 where a sequence starts: a token attends only to tokens of its own sequence (and, with
    ``causal``, not to later ones), as if each sequence ran on its own. Needs L == S."""
    _check_attention(q, k, v)
    if cu_seqlens is not None or position_ids is not None:
        packed = _packed_mask(q, k, cu_seqlens, position_ids)
        if attn_mask is None:
            attn_mask = packed
        elif attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & packed
        else:
            attn_mask = attn_mask.masked_fill(~packed, float("-inf"))
    if _on_torchacc(q):
        q, k, v = _autocast((q, k, v), q.device.type)
        return _kernels().attention(q, k, v, attn_mask, dropout_p, causal, scale)
    if causal and attn_mask is not None:
        L, S = q.shape[-2], k.shape[-2]
        tril = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & tril
        else:
            attn_mask = attn_mask.masked_fill(~tril, float("-inf"))
        causal = False
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=causal,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def _packed_mask(q, k, cu_seqlens, position_ids):
    """(B or 1, 1, L, L) bool: same sequence of the packed row."""
    name = "torchacc_ops.flash_attention"
    L = q.shape[-2]
    if k.shape[-2] != L:
        raise ValueError(
            f"{name}: packed sequences need q and k of one length, got {L}, {k.shape[-2]}"
        )
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError(f"{name}: give cu_seqlens or position_ids, not both")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"{name}: cu_seqlens must be a 1-d integer tensor [0, l1, l1 + l2, ..., L], got "
                f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
            )
        positions = torch.arange(L, device=cu_seqlens.device)
        # a token's sequence: how many starts (after the first) are at or before it
        segment = (positions[None, :] >= cu_seqlens[1:-1, None]).sum(0)[None, :]
    else:
        if position_ids.dim() != 2 or position_ids.shape[-1] != L:
            raise ValueError(
                f"{name}: position_ids must be (batch, {L}), got {tuple(position_ids.shape)}"
            )
        segment = (position_ids == 0).cumsum(-1)
    segment = segment.to(q.device)
    return (segment[:, :, None] == segment[:, None, :]).unsqueeze(1)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension: ``F.rms_norm(x, (x.shape[-1],), weight, eps)`` (output in
    x's dtype; float32 under autocast, whose policy lists rms_norm as float32)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotary_cos_sin(
    seq_len: int,
    head_dim: int,
    base: float = 10000.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaMA's rotary tables, (seq_len, head_dim/2) each: angle t * base^(-2i/head_dim)."""
    if head_dim % 2:
        raise ValueError(f"torchacc_ops.rotary_cos_sin: head_dim {head_dim} must be even")
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, rotate-half (LLaMA/NeoX) convention:
    ``x * cos + rotate_half(x) * sin``. x: (..., L, D); cos/sin broadcast against x's leading
    dims with last dim D (HF's duplicated halves) or D/2 (:func:`rotary_cos_sin`). Math in
    float32, result in x's dtype."""
    if _on_torchacc(x):
        return _kernels().rotary(x, cos, sin)
    d = x.shape[-1]
    if d % 2 or cos.shape != sin.shape or cos.shape[-1] not in (d, d // 2):
        raise ValueError(
            f"torchacc_ops.apply_rotary_emb: x's last dim must be even and cos/sin's last dim "
            f"head_dim or head_dim/2, got x {tuple(x.shape)}, cos {tuple(cos.shape)}, "
            f"sin {tuple(sin.shape)}"
        )
    if cos.shape[-1] != d:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    xf = x.float()
    return (xf * cos.float() + _rotate_half(xf) * sin.float()).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating: ``F.silu(gate) * up`` (gate and up of one shape and dtype)."""
    if _on_torchacc(gate):
        return _kernels().swiglu(gate, up)
    return F.silu(gate) * up


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_rows: int = 0,
) -> torch.Tensor:
    """``F.cross_entropy`` of (..., vocab) logits against (...) class indices, float32 loss.

    On the torchacc device the logits stay in their dtype (bf16 under autocast: no float32 copy)
    and the lowering works on ``chunk_rows`` rows at a time (0: about 64 MiB of float32 each)."""
    if _on_torchacc(logits):
        return _kernels().cross_entropy(
            logits, target, ignore_index, reduction, label_smoothing, chunk_rows
        )
    vocab = logits.shape[-1]
    loss = F.cross_entropy(
        logits.reshape(-1, vocab),
        target.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return loss.float().reshape(target.shape) if reduction == "none" else loss.float()
