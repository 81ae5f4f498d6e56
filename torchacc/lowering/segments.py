"""Segment reductions: ``embedding_bag`` (forward and backward, the recommender models' op) and
``segment_reduce``, as ``jax.ops.segment_*`` over a per-element segment id.

embedding_bag's auxiliary outputs take the shapes torch's meta kernel gives (the ones the
backward reads): ``offset2bag`` is each index's bag, ``bag_size`` each bag's count of indices
other than ``padding_idx``, ``max_indices`` (max mode) the weight row each output element came from
(0 for an empty bag, as eager CPU). An index equal to ``padding_idx`` takes no part in a bag.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchacc.lowering.dtypes import opmath
from torchacc.lowering.registry import register

aten = torch.ops.aten

_SUM, _MEAN, _MAX = 0, 1, 2


def _bags(indices, offsets, include_last_offset, padding_idx):
    """(bag id per index, number of bags, mask of indices that count)."""
    n = indices.shape[0]
    nbags = offsets.shape[0] - (1 if include_last_offset else 0)
    pos = jnp.arange(n, dtype=offsets.dtype)
    bag = jnp.searchsorted(offsets, pos, side="right").astype(jnp.int64) - 1
    valid = (bag >= 0) & (bag < nbags)
    if include_last_offset and nbags >= 0:
        valid = valid & (pos < offsets[-1])
    if padding_idx >= 0:
        valid = valid & (indices != padding_idx)
    return jnp.clip(bag, 0, max(nbags - 1, 0)), nbags, valid


def _embedding_bag(
    weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx
):
    bag, nbags, valid = _bags(indices, offsets, include_last_offset, padding_idx)
    w = opmath(weight)
    rows = jnp.take(w, indices, axis=0)
    if per_sample_weights is not None:
        rows = rows * opmath(per_sample_weights)[:, None]
    count = jax.ops.segment_sum(valid.astype(jnp.int64), bag, nbags)
    seg = jnp.where(valid, bag, nbags)  # invalid indices go to a dropped extra segment
    max_idx = jnp.zeros((0,), jnp.int64)
    if mode == _MAX:
        out = jax.ops.segment_max(rows, seg, nbags + 1)[:nbags]
        out = jnp.where(count[:, None] > 0, out, 0)
        first = jnp.where(
            valid[:, None] & (rows == out[bag]), jnp.arange(rows.shape[0])[:, None], rows.shape[0]
        )
        first = jax.ops.segment_min(first, seg, nbags + 1)[:nbags]
        max_idx = jnp.where(count[:, None] > 0, jnp.take(indices, first, mode="clip"), 0)
    else:
        out = jax.ops.segment_sum(jnp.where(valid[:, None], rows, 0), bag, nbags)
        if mode == _MEAN:
            out = out / jnp.maximum(count, 1)[:, None].astype(out.dtype)
    return out.astype(weight.dtype), bag, count, max_idx.astype(jnp.int64)


def _fit(x, shape):
    """``x`` (1-D) zero-padded or cut to ``shape`` (the meta kernel's bag_size has one entry
    per offset, also with ``include_last_offset``)."""
    if x.shape == tuple(shape):
        return x
    n = shape[0]
    return jnp.pad(x, (0, max(n - x.shape[0], 0)))[:n]


@register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default, out_meta=True)
def embedding_bag(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
    *,
    out,
):
    y, bag, count, max_idx = _embedding_bag(
        weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx
    )
    return y, bag, _fit(count, out[2][0]), max_idx


@register(aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(
    grad,
    indices,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    per_sample_weights,
    padding_idx=-1,
):
    g = opmath(grad)
    valid = indices != padding_idx if padding_idx >= 0 else jnp.ones(indices.shape, bool)
    if mode == _MAX:
        d = g.shape[1]
        size = bag_size[: maximum_indices.shape[0]]  # (one entry per offset: see _fit)
        rows = jnp.where(size[:, None] > 0, maximum_indices, num_weights)  # empty: dropped
        cols = jnp.broadcast_to(jnp.arange(d), rows.shape)
        out = jnp.zeros((num_weights + 1, d), g.dtype).at[rows, cols].add(g)[:num_weights]
    else:
        contrib = jnp.take(g, offset2bag, axis=0)
        if mode == _MEAN:
            size = jnp.take(bag_size, offset2bag)
            contrib = contrib / jnp.maximum(size, 1)[:, None].astype(g.dtype)
        if per_sample_weights is not None:
            contrib = contrib * opmath(per_sample_weights)[:, None]
        if scale_grad_by_freq:
            freq = jnp.zeros((num_weights,), jnp.int64).at[indices].add(valid.astype(jnp.int64))
            contrib = contrib / jnp.maximum(jnp.take(freq, indices), 1)[:, None].astype(g.dtype)
        contrib = jnp.where(valid[:, None], contrib, 0)
        out = jax.ops.segment_sum(contrib, indices, num_weights)
    return out.astype(grad.dtype)


@register(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(
    grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1
):
    g = jnp.take(opmath(grad), offset2bag, axis=0)
    w = jnp.take(opmath(weight), indices, axis=0)
    out = jnp.sum(g * w, axis=1)
    if padding_idx >= 0:
        out = jnp.where(indices == padding_idx, 0, out)
    return out.astype(grad.dtype)


def _segment_ids(lengths, offsets, size):
    """Segment id of each of ``size`` positions along the reduced axis, and the segment count
    (per leading batch row of ``lengths``/``offsets``; here 1-D only)."""
    if offsets is None:
        offsets = jnp.concatenate([jnp.zeros((1,), lengths.dtype), jnp.cumsum(lengths)])
    nseg = offsets.shape[-1] - 1
    pos = jnp.arange(size, dtype=offsets.dtype)
    seg = jnp.searchsorted(offsets, pos, side="right").astype(jnp.int32) - 1
    inside = (seg >= 0) & (seg < nseg) & (pos < offsets[-1])
    return jnp.where(inside, seg, nseg), nseg, offsets


@register(aten.segment_reduce.default)
def segment_reduce(
    data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None
):
    """torch's ``_segment_reduce`` over 1-D lengths/offsets: reduce "sum", "mean", "max", "min",
    "prod"; with ``initial``, it joins every segment (mean: (sum + initial) / count) and is an
    empty segment's value; without it an empty segment gives the reduction's identity (0, 1,
    -inf, inf) or NaN (mean), as eager."""
    if (lengths if lengths is not None else offsets).ndim != 1:
        raise NotImplementedError("torchacc: segment_reduce with batched lengths is not lowered")
    x = jnp.moveaxis(opmath(data), axis, 0)
    seg, nseg, offs = _segment_ids(lengths, offsets, x.shape[0])
    count = (offs[1:] - offs[:-1]).reshape((nseg,) + (1,) * (x.ndim - 1))
    fns = {
        "sum": jax.ops.segment_sum,
        "mean": jax.ops.segment_sum,
        "max": jax.ops.segment_max,
        "min": jax.ops.segment_min,
        "prod": jax.ops.segment_prod,
    }
    out = fns[reduce](x, seg, nseg + 1)[:nseg]
    if initial is not None:
        init = jnp.asarray(initial, x.dtype)
        out = {
            "sum": out + init,
            "prod": out * init,
            "max": jnp.maximum(out, init),
            "min": jnp.minimum(out, init),
        }.get(reduce, out)
        if reduce == "mean":
            out = (out + init) / count
    elif reduce == "mean":
        out = out / count
    if initial is not None:  # an empty segment is ``initial`` (without: the identity, mean NaN)
        out = jnp.where(count == 0, jnp.asarray(initial, x.dtype), out)
    return jnp.moveaxis(out, 0, axis).astype(data.dtype)


@register(aten.embedding_renorm.default)
def embedding_renorm(self, indices, max_norm, norm_type):
    """``embedding(max_norm=...)``'s renormalization (the functional form of
    ``embedding_renorm_``): each row that ``indices`` names whose ``norm_type``-norm exceeds
    ``max_norm`` is scaled to ``max_norm / (norm + 1e-7)`` of itself."""
    w = opmath(self)
    p = jnp.asarray(norm_type, w.dtype)
    norm = jnp.sum(jnp.abs(w) ** p, axis=1) ** (1 / p)
    scale = jnp.where(norm > max_norm, max_norm / (norm + 1e-7), 1.0)
    named = jnp.zeros((w.shape[0],), bool).at[indices.reshape(-1)].set(True)
    return jnp.where(named[:, None], w * scale[:, None].astype(w.dtype), w).astype(self.dtype)


@register(aten._embedding_bag_backward.default)
def embedding_bag_backward(
    grad,
    indices,
    offsets,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    sparse,
    per_sample_weights,
    padding_idx=-1,
):
    """The weight gradient; ``sparse=True`` (a sparse gradient) has no device layout."""
    if sparse:
        raise NotImplementedError(
            "torchacc: embedding_bag(sparse=True): sparse gradients are "
            "not supported on the device; use sparse=False"
        )
    return embedding_bag_dense_backward(
        grad,
        indices,
        offset2bag,
        bag_size,
        maximum_indices,
        num_weights,
        scale_grad_by_freq,
        mode,
        per_sample_weights,
        padding_idx,
    )
