"""View ops and their scatter inverses, joins, indexing, gathers/scatters, padding.

Every rule is functional: a view returns a new array with the view's logical contents; the core
keeps the aliasing bookkeeping. ``as_strided`` reads ``self`` as a flat, contiguous storage buffer
(the core passes the base), so its strides and offset index ``self.reshape(-1)``.

Data-dependent ops are left unregistered so the core falls back: ``nonzero``, ``masked_select`` and
``index.Tensor`` with a boolean mask (the rule raises). ``index_put`` with a boolean mask has a
static shape and is supported.
"""

from __future__ import annotations

import math
from itertools import pairwise

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchacc.lowering.dtypes import jdtype
from torchacc.lowering.pointwise import cast, result_type
from torchacc.lowering.registry import register

aten = torch.ops.aten


def _ops(*names):
    """Overloads by "packet.overload" name, skipping any this torch build lacks."""
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is not None:
            out.append(op)
    return out


def _dim(d, ndim):
    return d % max(ndim, 1)


# ----------------------------------------------------------------------------------------------
# Views


@register(*_ops("view", "_unsafe_view", "reshape", "view_copy", "_reshape_alias"))
def view(self, size, stride=None):
    return jnp.reshape(self, tuple(size))


@register(*_ops("view.dtype", "view_copy.dtype"))
def view_dtype(self, dtype):
    target = np.dtype(jdtype(dtype))
    x = self.astype(jnp.uint8) if self.dtype == jnp.bool_ else self
    to = np.dtype(jnp.uint8) if target == np.bool_ else target
    src, dst = x.dtype.itemsize, to.itemsize
    if src > dst:
        r = lax.bitcast_convert_type(x, to)  # (..., n, src // dst)
        r = r.reshape(r.shape[:-2] + (r.shape[-2] * r.shape[-1],))
    elif src < dst:
        r = lax.bitcast_convert_type(x.reshape(x.shape[:-1] + (-1, dst // src)), to)
    else:
        r = lax.bitcast_convert_type(x, to)
    return r != 0 if target == np.bool_ else r


@register(*_ops("expand", "expand_copy"))
def expand(self, size, *, implicit=False):
    lead = len(size) - self.ndim
    shape = tuple(self.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(self, shape)


@register(*_ops("permute", "permute_copy"))
def permute(self, dims):
    return jnp.transpose(self, [_dim(d, self.ndim) for d in dims])


@register(*_ops("transpose.int", "transpose_copy.int"))
def transpose(self, dim0, dim1):
    if self.ndim < 2:
        return self
    return jnp.swapaxes(self, _dim(dim0, self.ndim), _dim(dim1, self.ndim))


@register(*_ops("t", "t_copy"))
def t(self):
    return self if self.ndim < 2 else self.T


@register(*_ops("unsqueeze", "unsqueeze_copy"))
def unsqueeze(self, dim):
    return jnp.expand_dims(self, dim % (self.ndim + 1))


@register(
    *_ops("squeeze", "squeeze.dim", "squeeze.dims", "squeeze_copy", "squeeze_copy.dim",
          "squeeze_copy.dims")
)  # fmt: skip
def squeeze(self, dim=None):
    if dim is None:
        dims = range(self.ndim)
    else:
        dims = [dim] if isinstance(dim, int) else dim
    if self.ndim == 0:
        return self
    axes = tuple(sorted({_dim(d, self.ndim) for d in dims if self.shape[_dim(d, self.ndim)] == 1}))
    return jnp.squeeze(self, axes) if axes else self


def _slice_bounds(size, start, end, step):
    """torch's slice normalization: None/negative/overflowing bounds clamp into [0, size]."""
    start = 0 if start is None else start
    end = size if end is None else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, step


def _slicer(dim, sl):
    return (slice(None),) * dim + (sl,)


@register(*_ops("slice.Tensor", "slice_copy.Tensor"))
def slice_(self, dim=0, start=None, end=None, step=1):
    d = _dim(dim, self.ndim)
    start, end, step = _slice_bounds(self.shape[d], start, end, step)
    return lax.slice_in_dim(self, start, end, step, axis=d)


@register(*_ops("select.int", "select_copy.int"))
def select(self, dim, index):
    d = _dim(dim, self.ndim)
    return lax.index_in_dim(self, index % self.shape[d], axis=d, keepdims=False)


@register(*_ops("narrow", "narrow_copy"))
def narrow(self, dim, start, length):
    d = _dim(dim, self.ndim)
    start = start % self.shape[d] if start < 0 else start
    return lax.slice_in_dim(self, start, start + length, axis=d)


@register(aten.narrow.Tensor)
def narrow_tensor(self, dim, start, length):
    d = _dim(dim, self.ndim)
    start = jnp.reshape(start, ()).astype(jnp.int64)
    start = jnp.where(start < 0, start + self.shape[d], start)
    return lax.dynamic_slice_in_dim(self, start, length, axis=d)


@register(*_ops("diagonal", "diagonal_copy"))
def diagonal(self, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(self, offset, _dim(dim1, self.ndim), _dim(dim2, self.ndim))


@register(*_ops("split.Tensor", "split_copy.Tensor"))
def split(self, split_size, dim=0):
    d = _dim(dim, self.ndim)
    n = self.shape[d]
    if n == 0 or split_size == 0:
        return [self]
    return split_with_sizes(self, [min(split_size, n - s) for s in range(0, n, split_size)], d)


@register(*_ops("split_with_sizes", "split_with_sizes_copy", "split.sizes"))
def split_with_sizes(self, split_sizes, dim=0):
    d = _dim(dim, self.ndim)
    bounds = np.cumsum([0] + list(split_sizes))
    return [lax.slice_in_dim(self, int(a), int(b), axis=d) for a, b in pairwise(bounds)]


@register(*_ops("unbind.int", "unbind_copy.int"))
def unbind(self, dim=0):
    d = _dim(dim, self.ndim)
    return [lax.index_in_dim(self, i, axis=d, keepdims=False) for i in range(self.shape[d])]


_WINDOW_SLICES = 16  # unfold with at most this many elements per window uses strided slices


def _window_index(n, size, step):
    return np.arange(n)[:, None] * step + np.arange(size)[None, :]


@register(*_ops("unfold", "unfold_copy"))
def unfold(self, dimension, size, step):
    if self.ndim == 0:
        return jnp.reshape(self, (1,))
    d = _dim(dimension, self.ndim)
    n = (self.shape[d] - size) // step + 1
    if size <= _WINDOW_SLICES:
        last = (n - 1) * step
        parts = [lax.slice_in_dim(self, k, k + last + 1, step, axis=d) for k in range(size)]
        return jnp.stack(parts, axis=-1)
    w = jnp.moveaxis(self, d, -1)[..., _window_index(n, size, step)]  # (..., n, size)
    return jnp.moveaxis(w, -2, d)


# ----------------------------------------------------------------------------------------------
# as_strided over a flat contiguous buffer


def _strided_index(size, stride, offset):
    idx = np.full(tuple(size), offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride, strict=True)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return idx


def _strided_slice(flat, size, stride, offset):
    """as_strided as reshape/slice/transpose/broadcast when the strides nest; else None."""
    if any(s < 0 for s in stride):
        return None
    real = sorted((d for d in range(len(size)) if size[d] != 1 and stride[d] != 0),
                  key=lambda d: -stride[d])  # fmt: skip
    for a, b in pairwise(real):
        if stride[a] % stride[b] or size[b] * stride[b] > stride[a]:
            return None
    if not real:
        block = flat[offset]
    else:
        shape = [size[real[0]]]
        shape += [stride[a] // stride[b] for a, b in pairwise(real)]
        shape += [stride[real[-1]]]
        need = math.prod(shape)
        seg = flat[offset : offset + need]
        if seg.shape[0] < need:  # the last row runs past the buffer; those cells are unused
            seg = jnp.pad(seg, (0, need - seg.shape[0]))
        seg = seg.reshape(shape)
        seg = seg[(slice(None),) + tuple(slice(0, size[b]) for b in real[1:]) + (0,)]
        block = jnp.transpose(seg, np.argsort(real))
    keep = sorted(real)
    shape = [size[d] if d in keep else 1 for d in range(len(size))]
    return jnp.broadcast_to(jnp.reshape(block, shape), tuple(size))


@register(*_ops("as_strided", "as_strided_copy"))
def as_strided(self, size, stride, storage_offset=None):
    size, stride, offset = tuple(size), tuple(stride), storage_offset or 0
    flat = self.reshape(-1)
    if math.prod(size) == 0:
        return jnp.zeros(size, self.dtype)
    fast = _strided_slice(flat, size, stride, offset)
    if fast is not None:
        return fast
    return jnp.take(flat, _strided_index(size, stride, offset), mode="clip")


def _is_contiguous(size, stride):
    expected = 1
    for n, s in reversed(list(zip(size, stride, strict=True))):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


@register(aten.as_strided_scatter.default)
def as_strided_scatter(self, src, size, stride, storage_offset=None):
    size, stride, offset = tuple(size), tuple(stride), storage_offset or 0
    flat = self.reshape(-1)
    src = src.astype(self.dtype).reshape(-1)
    if _is_contiguous(size, stride):
        flat = lax.dynamic_update_slice(flat, src, (offset,))
    else:
        flat = flat.at[_strided_index(size, stride, offset).reshape(-1)].set(src)
    return flat.reshape(self.shape)


# ----------------------------------------------------------------------------------------------
# Scatter inverses of views and the view backwards


@register(aten.slice_scatter.default)
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    d = _dim(dim, self.ndim)
    start, end, step = _slice_bounds(self.shape[d], start, end, step)
    src = src.astype(self.dtype)
    if step == 1:
        return lax.dynamic_update_slice_in_dim(self, src, start, axis=d)
    return self.at[_slicer(d, slice(start, end, step))].set(src)


@register(aten.select_scatter.default)
def select_scatter(self, src, dim, index):
    d = _dim(dim, self.ndim)
    src = jnp.expand_dims(src.astype(self.dtype), d)
    return lax.dynamic_update_slice_in_dim(self, src, index % self.shape[d], axis=d)


@register(aten.diagonal_scatter.default)
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    d1, d2 = _dim(dim1, self.ndim), _dim(dim2, self.ndim)
    x = jnp.moveaxis(self, (d1, d2), (-2, -1))
    n = src.shape[-1]
    rows = np.arange(n) + max(-offset, 0)
    cols = np.arange(n) + max(offset, 0)
    x = x.at[..., rows, cols].set(src.astype(self.dtype))
    return jnp.moveaxis(x, (-2, -1), (d1, d2))


@register(aten.slice_backward.default)
def slice_backward(grad_output, input_sizes, dim, start, end, step):
    zeros = jnp.zeros(tuple(input_sizes), grad_output.dtype)
    return slice_scatter(zeros, grad_output, dim, start, end, step)


@register(aten.select_backward.default)
def select_backward(grad_output, input_sizes, dim, index):
    return select_scatter(jnp.zeros(tuple(input_sizes), grad_output.dtype), grad_output, dim, index)


@register(aten.diagonal_backward.default)
def diagonal_backward(grad_output, input_sizes, offset, dim1, dim2):
    zeros = jnp.zeros(tuple(input_sizes), grad_output.dtype)
    return diagonal_scatter(zeros, grad_output, offset, dim1, dim2)


@register(aten.unfold_backward.default)
def unfold_backward(grad_in, input_sizes, dim, size, step):
    shape = tuple(input_sizes)
    if not shape:
        return jnp.reshape(grad_in, ())
    d = _dim(dim, len(shape))
    length = shape[d]
    g = jnp.moveaxis(grad_in, d, -2)  # (..., n, size)
    n = g.shape[-2]
    if size <= _WINDOW_SLICES:
        out = jnp.zeros(g.shape[:-2] + (length,), grad_in.dtype)
        for k in range(size):
            hi = length - (k + (n - 1) * step + 1)
            cfg = [(0, 0, 0)] * (g.ndim - 2) + [(k, hi, step - 1)]
            out = out + lax.pad(g[..., k], jnp.zeros((), g.dtype), cfg)
    else:
        out = jnp.zeros(g.shape[:-2] + (length,), grad_in.dtype)
        out = out.at[..., _window_index(n, size, step)].add(g)
    return jnp.moveaxis(out, -1, d)


# ----------------------------------------------------------------------------------------------
# Joins and rearrangements


@register(aten.cat.default)
def cat(tensors, dim=0):
    dt = result_type(*tensors)
    keep = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]  # legacy empties
    if not keep:
        return jnp.zeros((0,), dt)
    return jnp.concatenate([t.astype(dt) for t in keep], axis=_dim(dim, keep[0].ndim))


@register(aten.stack.default)
def stack(tensors, dim=0):
    dt = result_type(*tensors)
    return jnp.stack([t.astype(dt) for t in tensors], axis=dim % (tensors[0].ndim + 1))


@register(aten.flip.default)
def flip(self, dims):
    axes = tuple(_dim(d, self.ndim) for d in dims)
    return jnp.flip(self, axes) if axes and self.ndim else self


@register(aten.roll.default)
def roll(self, shifts, dims=()):
    if not dims:
        return jnp.roll(self.reshape(-1), shifts[0]).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), tuple(_dim(d, self.ndim) for d in dims))


@register(aten.repeat.default)
def repeat(self, repeats):
    x = self.reshape((1,) * (len(repeats) - self.ndim) + self.shape)
    return jnp.tile(x, tuple(repeats))


@register(aten.constant_pad_nd.default)
def constant_pad_nd(self, pad, value=0):
    n = len(pad) // 2
    cfg = []
    for d in range(self.ndim):
        i = self.ndim - 1 - d
        cfg.append((pad[2 * i], pad[2 * i + 1], 0) if i < n else (0, 0, 0))
    return lax.pad(self, cast(value, self.dtype), cfg)


@register(aten.tril.default)
def tril(self, diagonal=0):
    return jnp.tril(self, diagonal)


@register(aten.triu.default)
def triu(self, diagonal=0):
    return jnp.triu(self, diagonal)


# ----------------------------------------------------------------------------------------------
# Advanced indexing


def _is_mask(t):
    return t is not None and t.dtype in (jnp.bool_, jnp.uint8)


def _index_tuple(indices):
    """torch's Tensor?[] indices -> a numpy-style index (None -> full slice).

    numpy's rules for advanced indices separated by slices (moved to the front) are torch's.
    """
    return tuple(slice(None) if t is None else t for t in indices)


@register(*_ops("index.Tensor", "index.Tensor_hacked_twin", "_unsafe_index.Tensor",
                "_unsafe_index.Tensor_hacked_twin"))  # fmt: skip
def index(self, indices):
    if any(_is_mask(t) for t in indices):
        raise NotImplementedError("torchacc: boolean-mask indexing has a data-dependent shape")
    return self[_index_tuple(indices)]


def _mask_put(self, indices, values, accumulate):
    """index_put with one boolean mask (after only full slices): a select, or nonzero(size=N)."""
    pos = next(i for i, t in enumerate(indices) if t is not None)
    mask = indices[pos] != 0
    if any(t is not None for t in indices[pos + 1 :]) or pos + mask.ndim > self.ndim:
        raise NotImplementedError("torchacc: index_put with a mask mixed with other indices")
    k, rest = mask.ndim, self.ndim - pos - mask.ndim
    v = values.astype(self.dtype)
    v = v.reshape((1,) * (pos + 1 + rest - v.ndim) + v.shape)
    if v.shape[pos] == 1:  # one value for every selected position: a select
        v = v.reshape(v.shape[:pos] + (1,) * k + v.shape[pos + 1 :])
        m = mask.reshape((1,) * pos + mask.shape + (1,) * rest)
        if accumulate:
            return self + jnp.where(m, v, jnp.zeros((), self.dtype))
        return jnp.where(m, v, self)
    coords = jnp.nonzero(mask, size=v.shape[pos])  # v's length says how many are selected
    idx = (slice(None),) * pos + tuple(coords)
    return self.at[idx].add(v) if accumulate else self.at[idx].set(v)


@register(*_ops("index_put", "index_put.hacked_twin", "_unsafe_index_put",
                "_unsafe_index_put.hacked_twin"))  # fmt: skip
def index_put(self, indices, values, accumulate=False):
    if any(_is_mask(t) for t in indices):
        return _mask_put(self, indices, values, accumulate)
    idx = _index_tuple(indices)
    v = values.astype(self.dtype)
    return self.at[idx].add(v) if accumulate else self.at[idx].set(v)


@register(aten.take.default)
def take(self, index):
    flat = self.reshape(-1)
    return jnp.take(flat, jnp.where(index < 0, index + flat.shape[0], index))


@register(aten.index_select.default)
def index_select(self, dim, index):
    if self.ndim == 0:
        return jnp.take(self.reshape(1), index.reshape(-1), axis=0).reshape(())
    return jnp.take(self, index.reshape(-1), axis=_dim(dim, self.ndim))


@register(aten.gather.default)
def gather(self, dim, index, *, sparse_grad=False):
    if self.ndim == 0:
        return jnp.broadcast_to(self, index.shape)
    d = _dim(dim, self.ndim)
    part = self[tuple(slice(None) if i == d else slice(0, n) for i, n in enumerate(index.shape))]
    return jnp.take_along_axis(part, index, axis=d)


def _coords(index, dim):
    """Full coordinates of every element of ``index`` along ``dim`` (torch's scatter indexing)."""
    return tuple(
        index if i == dim else lax.broadcasted_iota(jnp.int64, index.shape, i)
        for i in range(index.ndim)
    )


def _scatter_values(src, index, dtype):
    if not hasattr(src, "ndim") or src.ndim == 0:
        return jnp.broadcast_to(cast(src, dtype), index.shape)
    return src[tuple(slice(0, n) for n in index.shape)].astype(dtype)


_SCATTER_AT = {
    None: lambda ref, v: ref.set(v),
    "add": lambda ref, v: ref.add(v),
    "sum": lambda ref, v: ref.add(v),
    "multiply": lambda ref, v: ref.multiply(v),
    "prod": lambda ref, v: ref.multiply(v),
    "amax": lambda ref, v: ref.max(v),
    "amin": lambda ref, v: ref.min(v),
}


def _scatter(self, dim, index, src, reduce=None):
    if self.ndim == 0:
        return _scatter(self.reshape(1), 0, index.reshape(1), jnp.reshape(src, (1,)), reduce)[0]
    d = _dim(dim, self.ndim)
    coords = _coords(index, d)
    return _SCATTER_AT[reduce](self.at[coords], _scatter_values(src, index, self.dtype))


@register(aten.scatter.src, aten.scatter.value)
def scatter(self, dim, index, src):
    return _scatter(self, dim, index, src)


@register(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_reduce_legacy(self, dim, index, src, *, reduce):
    return _scatter(self, dim, index, src, reduce)


@register(aten.scatter_add.default)
def scatter_add(self, dim, index, src):
    return _scatter(self, dim, index, src, "add")


def _identity(reduce, dtype):
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if jnp.issubdtype(dtype, jnp.floating):
        return -np.inf if reduce == "amax" else np.inf
    if dtype == jnp.bool_:
        return reduce == "amin"
    info = jnp.iinfo(dtype)
    return info.min if reduce == "amax" else info.max


@register(aten.scatter_reduce.two)
def scatter_reduce(self, dim, index, src, reduce, *, include_self=True):
    if self.ndim == 0:
        r = scatter_reduce(self.reshape(1), 0, index.reshape(1), src.reshape(1), reduce,
                           include_self=include_self)  # fmt: skip
        return r[0]
    d = _dim(dim, self.ndim)
    coords = _coords(index, d)
    values = _scatter_values(src, index, self.dtype)
    base = self
    if not include_self:
        base = self.at[coords].set(jnp.asarray(_identity(reduce, self.dtype), self.dtype))
    if reduce != "mean":
        return _SCATTER_AT[reduce](base.at[coords], values)
    total = base.at[coords].add(values)
    count = jnp.zeros(self.shape, jnp.int64).at[coords].add(1) + (1 if include_self else 0)
    count = jnp.maximum(count, 1).astype(self.dtype)
    if jnp.issubdtype(self.dtype, jnp.floating):
        return total / count
    return jnp.floor_divide(total, count)


def _along(self, dim, fn):
    """Apply ``fn(x)`` to ``self`` with ``dim`` moved to the front (0-d treated as 1 element)."""
    if self.ndim == 0:
        return fn(self.reshape(1)).reshape(())
    d = _dim(dim, self.ndim)
    return jnp.moveaxis(fn(jnp.moveaxis(self, d, 0)), 0, d)


def _front(source, dim, ndim):
    if source.ndim == 0:
        return source.reshape(1)
    return jnp.moveaxis(source, _dim(dim, ndim), 0)


@register(aten.index_add.default)
def index_add(self, dim, index, source, *, alpha=1):
    src = _front(source, dim, self.ndim).astype(self.dtype)
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        src = src * cast(alpha, self.dtype)
    return _along(self, dim, lambda x: x.at[index.reshape(-1)].add(src))


@register(aten.index_copy.default)
def index_copy(self, dim, index, source):
    src = _front(source, dim, self.ndim).astype(self.dtype)
    return _along(self, dim, lambda x: x.at[index.reshape(-1)].set(src))


@register(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(self, dim, index, value):
    return _along(self, dim, lambda x: x.at[index.reshape(-1)].set(cast(value, self.dtype)))


@register(aten.masked_scatter.default)
def masked_scatter(self, mask, source):
    m = jnp.broadcast_to(mask != 0, self.shape).reshape(-1)
    pos = jnp.cumsum(m.astype(jnp.int64)) - 1
    src = source.reshape(-1).astype(self.dtype)
    if src.shape[0] == 0:
        return self
    vals = jnp.take(src, jnp.clip(pos, 0, src.shape[0] - 1))
    return jnp.where(m, vals, self.reshape(-1)).reshape(self.shape)
