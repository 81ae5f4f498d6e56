"""``torchacc.ops``: TorchAcc's kernel names over torchacc_ops.

``flash_attn_varlen_xla`` is flash-attn's varlen interface (packed tokens, ``cu_seqlens``) as
TorchAcc names it; it runs torchacc_ops' ``flash_attention`` with the packed-sequence mask.

``context_parallel`` is TorchAcc's context parallel (Ulysses, ring attention, split/gather),
torchacc/context_parallel/; ``import torchacc.ops.context_parallel`` works too.
"""

from __future__ import annotations

import sys

import torchacc_ops
from torchacc import context_parallel

# TorchAcc's import paths: `torchacc.ops` and `torchacc.ops.context_parallel`
sys.modules.setdefault("torchacc.ops", sys.modules[__name__])
sys.modules.setdefault("torchacc.ops.context_parallel", context_parallel)


def flash_attn_varlen_xla(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
):
    """Attention over packed sequences: q (total, Hq, D), k/v (total, Hkv, D), sequence ``i``
    being tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``; returns (total, Hq, D). ``max_seqlen_*``
    are accepted and unused (shapes are static under XLA)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"flash_attn_varlen_xla: q, k, v must be (total_tokens, heads, head_dim), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if cu_seqlens_k is not cu_seqlens_q and (
        cu_seqlens_k.shape != cu_seqlens_q.shape or not bool((cu_seqlens_k == cu_seqlens_q).all())
    ):
        raise NotImplementedError(
            "flash_attn_varlen_xla: cu_seqlens_k different from cu_seqlens_q (cross-attention "
            "over packed sequences) is not supported"
        )
    out = torchacc_ops.flash_attention(
        *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
        causal=causal,
        dropout_p=dropout_p,
        scale=softmax_scale,
        cu_seqlens=cu_seqlens_q,
    )
    return out.squeeze(0).transpose(0, 1)


__all__ = ["context_parallel", "flash_attn_varlen_xla"]
