"""``torchacc.ops.context_parallel``: TorchAcc's context parallel (Ulysses, ring attention, the
split/gather helpers) as manual regions over the ``cp`` axis of the one mesh.

SPMD style: the tensors are global (``[batch, seq, heads, head_dim]``); each op is one
``jax.shard_map`` over the mesh ``initialize_context_parallel`` makes (axes ``dp`` x ``cp``),
the sequence dimension split on ``cp`` and the batch on ``dp``, with JAX's collectives inside
(Note [Context parallel]). Each op is one node of the step forward and one backward (the
backward is JAX's VJP of the same region, recomputing the forward). Nothing of torchacc's own
moves data: ``all_to_all`` / ``ppermute`` are JAX's, the layouts around the region XLA's.

Note [Context parallel]
    Ulysses: each device holds ``seq / cp`` tokens of every head; an ``all_to_all`` over ``cp``
    trades them for every token of ``heads / cp`` heads, attention runs locally, and a second
    ``all_to_all`` trades back. Needs heads (of q and of k/v) divisible by cp.
    Ring: each device keeps its queries and passes its K/V block to the next device of the ring
    (``ppermute``) cp - 1 times, merging each block's scores by online softmax (running max,
    running sum). Causal ring uses the zig-zag split: the sequence cut into 2 * cp chunks,
    device i holds chunks i and 2 * cp - 1 - i, so every device has the same amount of unmasked
    work; the reorder into and out of that layout is an XLA gather around the region. Masks are
    computed from the tokens' global positions, which travel with the K/V block. Needs seq
    divisible by cp (2 * cp when causal).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torchacc.lowering import region as _region
from torchacc.lowering.dtypes import jdtype, tdtype
from torchacc.sharding import api

__all__ = [
    "initialize_context_parallel",
    "get_context_parallel_group",
    "ulysses",
    "ring_attention",
    "split_forward_gather_backward",
    "gather_forward_split_backward",
]

_NEG = -1e30  # a masked score: finite, so a block with every key masked gives no NaN


class ContextParallelGroup:
    """The ``cp`` axis of a ``dp x cp`` mesh over every device of the job (what
    ``get_context_parallel_group()`` returns and ``process_group=`` takes)."""

    axis = "cp"

    def __init__(self, mesh, intra_size=None):
        self.mesh = mesh
        self.size = int(mesh.shape["cp"])
        self.intra_size = intra_size

    def __repr__(self):
        return f"ContextParallelGroup(cp={self.size}, mesh={dict(self.mesh.shape)})"


_group: list = [None]


def initialize_context_parallel(cp_size, intra_size=None):
    """Lay the job's devices out as a ``dp x cp`` mesh (``cp = cp_size`` consecutive devices per
    ring) and switch SPMD mode on. ``intra_size`` (TorchAcc's 2-D split) is recorded; the 2-D
    op is not built yet. Returns the group."""
    cp_size = int(cp_size)
    n = api.device_count()
    if cp_size < 1 or n % cp_size:
        raise ValueError(
            f"initialize_context_parallel: cp_size={cp_size} must divide the job's {n} devices"
        )
    if intra_size is not None and (int(intra_size) < 1 or cp_size % int(intra_size)):
        raise ValueError(
            f"initialize_context_parallel: intra_size={intra_size} must divide cp_size={cp_size}"
        )
    if not api.is_spmd():
        api.use_spmd()
    mesh = api.jax_mesh(range(n), (n // cp_size, cp_size), ("dp", "cp"))
    api.adopt_mesh(mesh)  # the step's results are laid out on it (dp x cp shardings)
    _group[0] = ContextParallelGroup(mesh, intra_size)
    return _group[0]


def get_context_parallel_group():
    """The group of :func:`initialize_context_parallel` (a RuntimeError before it)."""
    if _group[0] is None:
        raise RuntimeError(
            "get_context_parallel_group: call initialize_context_parallel(cp_size) first"
        )
    return _group[0]


def _resolve(process_group, call):
    if process_group is None:
        if _group[0] is None:
            raise RuntimeError(f"{call}: call initialize_context_parallel(cp_size) first")
        return _group[0]
    if isinstance(process_group, ContextParallelGroup):
        return process_group
    raise ValueError(
        f"{call}: process_group must be the group of get_context_parallel_group() (or None), "
        f"got {process_group!r}; torch process groups (one sequence chunk per process) are not "
        "supported yet"
    )


# ---------------------------------------------------------------------------------------------
# a JAX function as one node forward and one backward (its VJP)

_calls: dict = {}


def _jax_node(fn, tensors, name):
    """``fn(*arrays)`` (a tuple of arrays) as one recorded node on the torchacc tensors."""
    key = (fn, tuple((tuple(t.shape), t.dtype) for t in tensors))
    call = _calls.get(key)
    if call is None:
        specs = [jax.ShapeDtypeStruct(tuple(t.shape), jdtype(t.dtype)) for t in tensors]
        precision = jax.config.jax_default_matmul_precision
        with jax.default_matmul_precision(precision):
            outs = jax.eval_shape(fn, *specs)
        leaves, out_tree = jax.tree_util.tree_flatten(outs)
        meta = [(tuple(o.shape), tdtype(o.dtype)) for o in leaves]
        _, treedef = jax.tree_util.tree_flatten((tuple(specs), {}))
        fn.__name__ = name
        call = _region.JaxCall(fn, treedef, range(len(specs)), {}, precision, meta, out_tree)
        _calls[key] = call
    return list(_region.call_jax(list(tensors), call.key))


_vjps: dict = {}  # forward -> its VJP function (one per forward, so its node is cached too)


def _with_vjp(fwd, tensors, name):
    """``fwd`` (arrays -> one array) on ``tensors`` with autograd: the backward is one node
    running ``jax.vjp(fwd)``."""

    bwd = _vjps.get(fwd)
    if bwd is None:

        def bwd(*args):
            *xs, g = args
            return jax.vjp(fwd, *xs)[1](g)

        _vjps[fwd] = bwd

    class _Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ts):
            ctx.save_for_backward(*ts)
            return _jax_node(fwd, ts, name)[0]

        @staticmethod
        def backward(ctx, g):
            return tuple(_jax_node(bwd, (*ctx.saved_tensors, g.contiguous()), name + "_bwd"))

    return _Op.apply(*tensors)


_fns: dict = {}  # (kind, static config) -> (fwd jax function); one per config so nodes cache


def _cached(key, make):
    f = _fns.get(key)
    if f is None:
        f = _fns[key] = make()
    return f


# ---------------------------------------------------------------------------------------------
# attention on one device's blocks


def _expand_kv(k, hq):
    """GQA/MQA: repeat k/v heads up to the query heads."""
    hk = k.shape[2]
    return k if hk == hq else jnp.repeat(k, hq // hk, axis=2)


def _scores(q, k, scale):
    """[b, sq, h, d] x [b, sk, h, d] -> [b, h, sq, sk] in float32."""
    k = _expand_kv(k, q.shape[2])
    return jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale


def _local_attention(q, k, v, scale, causal):
    s = _scores(q, k, scale)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        mask = jnp.arange(sq)[:, None] + (sk - sq) >= jnp.arange(sk)[None, :]
        s = jnp.where(mask, s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v, q.shape[2]).astype(jnp.float32))
    return out.astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# checks


def _check_qkv(q, k, v, call, dropout_p, q_lens, k_lens):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{call}: {name} must be [batch, seq, heads, head_dim], got shape {tuple(t.shape)}"
            )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"{call}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match "
            "(k and v equal; batch and head_dim as q's)"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{call}: q's {q.shape[2]} heads must be a multiple of k/v's {k.shape[2]} (GQA)"
        )
    if dropout_p:
        raise NotImplementedError(f"{call}: dropout_p={dropout_p} (only 0.0 is supported)")
    if q_lens is not None or k_lens is not None:
        raise NotImplementedError(f"{call}: q_lens / k_lens (varlen) are not supported yet")


def _batch_axis(group, b):
    dp = int(group.mesh.shape["dp"])
    return "dp" if dp > 1 and b % dp == 0 else None


# ---------------------------------------------------------------------------------------------
# Ulysses


def ulysses(
    q,
    k,
    v,
    q_lens=None,
    k_lens=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    process_group=None,
):
    """Attention of ``q, k, v`` ([batch, seq, heads, head_dim]) with the sequence split on the
    ``cp`` axis, by all-to-all over heads (Note [Context parallel]). Returns q's shape."""
    call = "ulysses"
    group = _resolve(process_group, call)
    _check_qkv(q, k, v, call, dropout_p, q_lens, k_lens)
    cp = group.size
    if q.shape[2] % cp or k.shape[2] % cp:
        raise ValueError(
            f"{call}: q's {q.shape[2]} heads and k/v's {k.shape[2]} heads must be divisible by "
            f"cp={cp}"
        )
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ValueError(
            f"{call}: q's sequence length {q.shape[1]} and k/v's {k.shape[1]} must be divisible "
            f"by cp={cp}"
        )
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    bax = _batch_axis(group, q.shape[0])

    def make():
        spec = P(bax, "cp", None, None)

        def body(q, k, v):
            def gather_seq(x):  # [b, s/cp, h, d] -> [b, s, h/cp, d]
                return jax.lax.all_to_all(x, "cp", 2, 1, tiled=True)

            out = _local_attention(gather_seq(q), gather_seq(k), gather_seq(v), scale, causal)
            return jax.lax.all_to_all(out, "cp", 1, 2, tiled=True)

        def fwd(q, k, v):
            return jax.shard_map(
                body, mesh=group.mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False
            )(q, k, v)

        return fwd

    fwd = _cached(("ulysses", id(group.mesh), bax, scale, bool(causal)), make)
    return _with_vjp(fwd, (q, k, v), "ulysses")


# ---------------------------------------------------------------------------------------------
# ring attention


def _zigzag_order(cp):
    """Chunk order of the zig-zag layout: device i holds chunks i and 2 * cp - 1 - i."""
    return [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]


def ring_attention(
    q,
    k,
    v,
    q_lens=None,
    k_lens=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    process_group=None,
):
    """Attention of ``q, k, v`` ([batch, seq, heads, head_dim]) with the sequence split on the
    ``cp`` axis: K/V blocks go around the ring (``ppermute``), merged by online softmax; causal
    attention uses the zig-zag split (Note [Context parallel]). Returns q's shape."""
    call = "ring_attention"
    group = _resolve(process_group, call)
    _check_qkv(q, k, v, call, dropout_p, q_lens, k_lens)
    cp = group.size
    chunks = 2 * cp if causal else cp
    if q.shape[1] % chunks or k.shape[1] % chunks:
        raise ValueError(
            f"{call}: q's sequence length {q.shape[1]} and k/v's {k.shape[1]} must be divisible "
            f"by {'2 * cp' if causal else 'cp'}={chunks} (cp={cp}"
            + (", zig-zag split for causal balance)" if causal else ")")
        )
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"{call}: causal attention needs q and k/v of one sequence length, got {q.shape[1]} "
            f"and {k.shape[1]}"
        )
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    bax = _batch_axis(group, q.shape[0])

    def make():
        spec = P(bax, "cp", None, None)
        pos_spec = P("cp")
        ring = [(i, (i + 1) % cp) for i in range(cp)]

        def body(q, k, v, qpos, kpos):
            b, sq, h, d = q.shape
            m = jnp.full((b, h, sq), _NEG, jnp.float32)
            den = jnp.zeros((b, h, sq), jnp.float32)
            acc = jnp.zeros((b, h, sq, d), jnp.float32)
            for step in range(cp):
                s = _scores(q, k, scale)
                if causal:
                    mask = (qpos[:, None] >= kpos[None, :])[None, None]
                    s = jnp.where(mask, s, _NEG)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - m_new[..., None])
                if causal:
                    p = jnp.where(mask, p, 0.0)
                alpha = jnp.exp(m - m_new)
                den = den * alpha + p.sum(-1)
                vv = _expand_kv(v, h).astype(jnp.float32)
                acc = acc * alpha[..., None] + jnp.einsum("bhqk,bkhd->bhqd", p, vv)
                m = m_new
                if step + 1 < cp:
                    k, v, kpos = (jax.lax.ppermute(x, "cp", ring) for x in (k, v, kpos))
            out = acc / den[..., None]
            return jnp.transpose(out, (0, 2, 1, 3)).astype(q.dtype)

        def fwd(q, k, v):
            s = q.shape[1]
            pos = jnp.arange(s, dtype=jnp.int32)
            if causal:  # the zig-zag layout: reorder chunks, positions travel with them
                order = np.array(_zigzag_order(cp))
                c = s // chunks

                def zig(x):
                    x = x.reshape(x.shape[0], chunks, c, *x.shape[2:])[:, order]
                    return x.reshape(x.shape[0], s, *x.shape[3:])

                q, k, v = zig(q), zig(k), zig(v)
                pos = pos.reshape(chunks, c)[order].reshape(s)
            out = jax.shard_map(
                body,
                mesh=group.mesh,
                in_specs=(spec, spec, spec, pos_spec, pos_spec),
                out_specs=spec,
                check_vma=False,
            )(q, k, v, pos, pos)
            if causal:  # back to the natural order
                inverse = np.argsort(order)
                out = out.reshape(out.shape[0], chunks, c, *out.shape[2:])[:, inverse]
                out = out.reshape(out.shape[0], s, *out.shape[3:])
            return out

        return fwd

    fwd = _cached(("ring", id(group.mesh), bax, scale, bool(causal)), make)
    return _with_vjp(fwd, (q, k, v), "ring_attention")


# ---------------------------------------------------------------------------------------------
# split / gather


def _check_dim(x, dim, group, call):
    if x.dim() == 0:
        raise ValueError(f"{call}: expects a tensor of rank >= 1, got a 0-d tensor")
    d = dim % x.dim() if -x.dim() <= dim < x.dim() else None
    if d is None:
        raise ValueError(f"{call}: dim={dim} out of range for a tensor of shape {tuple(x.shape)}")
    if x.shape[d] % group.size:
        raise ValueError(
            f"{call}: dimension {d} of size {x.shape[d]} (shape {tuple(x.shape)}) is not "
            f"divisible by cp={group.size}"
        )
    return d


def _layout_op(x, d, group, split_forward, name):
    ndim = x.dim()
    split = NamedSharding(group.mesh, P(*[("cp" if i == d else None) for i in range(ndim)]))
    whole = NamedSharding(group.mesh, P())
    first, second = (split, whole) if split_forward else (whole, split)

    def make():
        def fwd(x):
            return jax.lax.with_sharding_constraint(x, first)

        return fwd

    fwd = _cached((name, id(group.mesh), d, ndim), make)

    def make_bwd():
        def bwd(g):
            return jax.lax.with_sharding_constraint(g, second)

        return bwd

    bwd = _cached((name + "_bwd", id(group.mesh), d, ndim), make_bwd)

    class _Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return _jax_node(fwd, (t,), name)[0]

        @staticmethod
        def backward(ctx, g):
            return _jax_node(bwd, (g.contiguous(),), name + "_bwd")[0]

    return _Op.apply(x)


def split_forward_gather_backward(x, dim, process_group=None):
    """SPMD style: ``x`` (global) laid out split along ``dim`` on the ``cp`` axis, each device
    holding its chunk; its gradient is gathered (replicated) in the backward. Values unchanged:
    in SPMD style a "split" is a layout, the tensor keeps its global shape."""
    call = "split_forward_gather_backward"
    group = _resolve(process_group, call)
    d = _check_dim(x, dim, group, call)
    return _layout_op(x, d, group, True, "cp_split")


def gather_forward_split_backward(x, dim, process_group=None):
    """SPMD style: ``x`` gathered (replicated over ``cp``) forward; its gradient laid out split
    along ``dim`` on ``cp`` in the backward. Values unchanged."""
    call = "gather_forward_split_backward"
    group = _resolve(process_group, call)
    d = _check_dim(x, dim, group, call)
    return _layout_op(x, d, group, False, "cp_gather")
