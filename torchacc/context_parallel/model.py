"""Context parallel for a whole model: what ``ta.accelerate``'s ``dist.sp`` and the gallery's
``--cp`` apply (Note [Context parallel for a model]). It owns the batch layout of the
sequence split and the model's attention calls, routed into the regions of
torchacc/context_parallel/__init__.py over the ``cp`` axis of the job's one mesh.

Note [Context parallel for a model]
    In SPMD style the sequence split is a layout: the batch's dim 1 (token ids, labels,
    position ids, attention masks of [batch, seq]) lies on the cp axis, and XLA's partitioner
    carries that split through every per-token layer (embeddings, norms, projections, MLP, the
    loss) with no collective. Only attention mixes tokens; left to the partitioner it would
    gather K/V whole on every device. So, inside the model's forward only, the attention calls
    are the region's:
    - ``F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal, scale, enable_gqa)``
      (gallery GPT-2/LLaMA without kernels, Hugging Face's "sdpa" attention): causal or not,
      GQA, an ``attn_mask`` [batch or 1, heads or 1, q seq, k seq] (a packed-rows mask, HF's
      4-D causal+padding mask, a per-head bias such as ALiBi's) taken row-split (Note [Context
      parallel masks]) and ``dropout_p`` (Note [Context parallel dropout]);
    - ``torchacc_ops.flash_attention(..., position_ids= / cu_seqlens=)`` (the gallery's
      ``--kernel-opt`` models): packed rows become segment ids, O(seq / cp) per device;
    - ``ta.ops.context_parallel.ulysses`` / ``ring_attention`` called by the model itself: the
      group they default to is this mesh's cp axis.
    The algorithm ("auto"): Ulysses when the heads on a device (heads / tp) and the key/value
    heads are divisible by cp and no general mask is given, else the ring (zig-zag when
    causal). The heads stay on the tp axis inside the region (Megatron's head split); the batch
    stays on the data axes. Attention written by hand (matmul + softmax) is not intercepted:
    it is still right (the partitioner gathers what it needs) but holds K/V whole.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import torchacc_ops
from torchacc import context_parallel as cp
from torchacc.lazy.device import DEVICE_TYPE

__all__ = ["parallelize", "batch_spec", "ALGORITHMS"]

ALGORITHMS = ("auto", "ulysses", "ring")


def batch_spec(shape, batch_axes, cp_axis, cp_size):
    """The partition spec of a batch tensor: dim 0 over ``batch_axes`` (when it divides), dim
    1 (the sequence) over ``cp_axis`` when it divides by ``cp_size``; the rest whole."""
    spec = [None] * len(shape)
    if not shape:
        return ()
    spec[0] = (batch_axes[0] if len(batch_axes) == 1 else tuple(batch_axes)) or None
    if len(shape) >= 2 and cp_size > 1 and shape[1] % cp_size == 0:
        spec[1] = cp_axis
    return tuple(spec)


def _algorithm(group, q_heads, kv_heads, masked, algorithm):
    """ "ulysses" or "ring" for these heads (Note [Context parallel for a model])."""
    if algorithm != "auto":
        return algorithm
    tp = int(group.mesh.shape[group.head_axis]) if group.head_axis else 1
    fits = q_heads % (tp * group.size) == 0 and kv_heads % (tp * group.size) == 0
    return "ulysses" if fits and not masked else "ring"


def _run(
    group, algorithm, q, k, v, causal, scale, segments=(), mask=None, call="sdpa", dropout_p=0.0
):
    """Attention of [batch, heads, seq, head_dim] tensors over ``group``; the same layout back."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    algo = _algorithm(group, q.shape[2], k.shape[2], mask is not None, algorithm)
    a2a, ring = (group, None) if algo == "ulysses" else (None, group)
    name = f"context parallel {call} ({algo})"
    out = cp._attention(name, q, k, v, [], a2a, ring, scale, causal, segments, mask, dropout_p)
    return out.transpose(1, 2)


def _segments_of(position_ids, cu_seqlens, shape):
    """Segment ids [batch, seq] of packed rows: from position ids restarting at 0, or from the
    cumulative starts ``cu_seqlens`` (the same for every row)."""
    if position_ids is not None:
        return (position_ids == 0).to(torch.int32).cumsum(-1).to(torch.int32)
    b, length = shape
    starts = cu_seqlens[1:-1].to(torch.int32)
    pos = torch.arange(length, device=cu_seqlens.device, dtype=torch.int32)
    seg = (pos[None, :] >= starts[:, None]).to(torch.int32).sum(0)
    return seg[None, :].expand(b, length).contiguous()


def _on_device(q):
    return isinstance(q, torch.Tensor) and q.device.type == DEVICE_TYPE and q.dim() == 4


def _sdpa(group, algorithm, original):
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not _on_device(q):
            return original(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa)
        if attn_mask is not None and attn_mask.dim() < 4:  # SDPA broadcasts from the right:
            attn_mask = attn_mask[(None,) * (4 - attn_mask.dim())]  # a 3-D mask's dim 0 is heads
        return _run(
            group, algorithm, q, k, v, bool(is_causal), scale, mask=attn_mask, dropout_p=dropout_p
        )

    return sdpa


def _flash(group, algorithm, original):
    def flash_attention(
        q,
        k,
        v,
        *,
        causal=False,
        attn_mask=None,
        dropout_p=0.0,
        scale=None,
        cu_seqlens=None,
        position_ids=None,
    ):
        if not _on_device(q):
            return original(
                q,
                k,
                v,
                causal=causal,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                scale=scale,
                cu_seqlens=cu_seqlens,
                position_ids=position_ids,
            )
        segments = ()
        if position_ids is not None or cu_seqlens is not None:
            seg = _segments_of(position_ids, cu_seqlens, (q.shape[0], q.shape[2]))
            segments = (seg, seg)
        return _run(
            group, algorithm, q, k, v, bool(causal), scale, segments, attn_mask, "flash", dropout_p
        )

    return flash_attention


def parallelize(
    model, mesh, cp_axis="cp", batch_axes=(), head_axis=None, algorithm="auto", call="dist.sp"
):
    """Context parallel over ``mesh``'s ``cp_axis`` for ``model`` (Note [Context parallel for
    a model]): inside its forward, SDPA and ``torchacc_ops.flash_attention`` on torchacc
    tensors run as the ring / Ulysses region, the batch on ``batch_axes`` and the heads on
    ``head_axis`` around it; ``ta.ops.context_parallel``'s ops default to this group. The
    caller lays the batch out (:func:`batch_spec`). Returns the group."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{call}: algorithm {algorithm!r} is not one of {list(ALGORITHMS)}")
    if cp_axis not in mesh.shape:
        raise ValueError(f"{call}: the mesh {dict(mesh.shape)} has no {cp_axis!r} axis")
    group = cp.ContextParallelGroup(mesh, (cp_axis,), batch_axes, head_axis)
    cp._groups["cp"] = group  # ulysses() / ring_attention() without a process_group
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        sdpa, flash = F.scaled_dot_product_attention, torchacc_ops.flash_attention
        F.scaled_dot_product_attention = _sdpa(group, algorithm, sdpa)
        torchacc_ops.flash_attention = _flash(group, algorithm, flash)
        try:
            return inner(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention, torchacc_ops.flash_attention = sdpa, flash

    model.forward = forward
    return group
