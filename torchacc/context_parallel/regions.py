"""The JAX half of ``torchacc.ops.context_parallel`` (torchacc/context_parallel/__init__.py): a JAX
function as one node of the step forward and its VJP backward, and the attention region itself
(Ulysses all-to-all, ring ppermute, online softmax, zig-zag), Note [Context parallel] there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.extend.random import threefry2x32_p
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torchacc.lowering import region as _region
from torchacc.lowering.dtypes import jdtype, tdtype

_NEG = -1e30  # a masked score: finite, so a block with every key masked gives no NaN

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


def _with_vjp(fwd, tensors, name, n_diff=None):
    """``fwd`` (arrays -> one array) on ``tensors`` with autograd: the backward is one node
    running ``jax.vjp(fwd)`` with respect to the first ``n_diff`` tensors (default: all; the
    rest, integer lengths, get no gradient)."""
    n_diff = len(tensors) if n_diff is None else n_diff
    bwd = _vjps.get((fwd, n_diff))
    if bwd is None:

        def bwd(*args):
            *xs, g = args
            rest = xs[n_diff:]
            return jax.vjp(lambda *d: fwd(*d, *rest), *xs[:n_diff])[1](g)

        _vjps[fwd, n_diff] = bwd

    class _Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ts):
            ctx.save_for_backward(*ts)
            return _jax_node(fwd, ts, name)[0]

        @staticmethod
        def backward(ctx, g):
            grads = _jax_node(bwd, (*ctx.saved_tensors, g.contiguous()), name + "_bwd")
            return (*grads, *[None] * (len(tensors) - n_diff))

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


def _keep_block(kd, dims, p, b0, h0, nb, nh, qpos, kpos):
    """The attention-dropout keep mask of one block of the global [B, H, Sq, Sk] scores: rows
    ``b0 + arange(nb)``, heads ``h0 + arange(nh)``, queries ``qpos``, keys ``kpos`` (global
    positions). Element (b, h, i, j) is ``jax.random.uniform(key, (B, H, Sq, Sk))[b, h, i, j]
    >= p`` for the key whose data is ``kd`` (Note [Context parallel dropout]): partitionable
    threefry draws an element's bits from its flat index alone, so a block computes just its
    own; without it (``jax_threefry_partitionable`` off) the whole draw is made and indexed."""
    B, H, Sq, Sk = dims
    u64 = jnp.uint64
    b = (b0 + jnp.arange(nb)).astype(u64)[:, None, None, None]
    h = (h0 + jnp.arange(nh)).astype(u64)[None, :, None, None]
    i, j = qpos.astype(u64)[None, None, :, None], kpos.astype(u64)[None, None, None, :]
    if not jax.config.jax_threefry_partitionable:
        full = jax.random.uniform(jax.random.wrap_key_data(kd), dims, jnp.float32)
        return full[b, h, i, j] >= jnp.float32(p)
    flat = ((b * u64(H) + h) * u64(Sq) + i) * u64(Sk) + j
    hi, lo = (flat >> u64(32)).astype(jnp.uint32), flat.astype(jnp.uint32)
    bits1, bits2 = threefry2x32_p.bind(kd[0], kd[1], hi, lo)
    mantissa = ((bits1 ^ bits2) >> jnp.uint32(9)) | jnp.uint32(0x3F800000)
    uniform = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - jnp.float32(1.0)
    return uniform >= jnp.float32(p)


def _axis_offset(axes, size):
    """This device's offset along a dimension split over ``axes`` in blocks of ``size``."""
    return jax.lax.axis_index(axes) * size if axes else 0


def _body(a2a, ring, n_ring, scale, causal, extras, dropout=None):
    """One device's attention: all-to-all over the ``a2a`` axes (Ulysses), then ``n_ring`` K/V
    blocks passed around the ``ring`` axes merged by online softmax. Masks come from the
    tokens' global positions (``qpos``, ``kpos``), which travel with the blocks, and from the
    ``extras`` (Note [Context parallel masks]): ``lens`` (q_lens, k_lens), ``segments`` (q's and
    k's segment ids; k's travel with the block) and ``mask`` (rows of q's tokens, every key;
    per-head masks traded like q under Ulysses). ``dropout``: (p, global [B, H, Sq, Sk], batch
    axes, head axis) with the key's data the last input (Note [Context parallel dropout])."""
    perm = [(i, (i + 1) % n_ring) for i in range(n_ring)]

    def gather(x, axis):  # a split of the sequence, gathered in the all-to-all's order
        return jax.lax.all_gather(x, a2a, axis=axis, tiled=True)

    def body(q, k, v, qpos, kpos, *rest):
        rest = list(rest)
        kd = rest.pop() if dropout else None
        b0 = h0 = 0
        if dropout:  # this device's first batch row and head of the global scores
            _, _, bax, hax = dropout
            b0 = _axis_offset(bax, q.shape[0])
            h0 = _axis_offset(hax, q.shape[2])
        lens = (rest.pop(0), rest.pop(0)) if "lens" in extras else ()
        qseg, kseg = (rest.pop(0), rest.pop(0)) if "segments" in extras else (None, None)
        full_mask = rest.pop(0) if "mask" in extras else None
        if a2a:  # [b, s/n, h, d] -> [b, s, h/n, d]; the positions gathered in the same order
            q, k, v = (jax.lax.all_to_all(x, a2a, 2, 1, tiled=True) for x in (q, k, v))
            qpos, kpos = gather(qpos, 0), gather(kpos, 0)
            if qseg is not None:
                qseg, kseg = gather(qseg, 1), gather(kseg, 1)
            if full_mask is not None and full_mask.shape[1] > 1:  # per head: traded like q
                full_mask = jax.lax.all_to_all(full_mask, a2a, 1, 2, tiled=True)
            elif full_mask is not None:
                full_mask = gather(full_mask, 2)
        b, sq, h, d = q.shape
        if dropout:  # the heads this device holds after the all-to-all
            h0 = h0 + _axis_offset(a2a, h)
        m = jnp.full((b, h, sq), _NEG, jnp.float32)
        den = jnp.zeros((b, h, sq), jnp.float32)
        acc = jnp.zeros((b, h, sq, d), jnp.float32)
        for step in range(n_ring):
            s = _scores(q, k, scale)
            mask = (qpos[:, None] >= kpos[None, :])[None, None] if causal else None
            if lens:  # varlen: keys at or past a row's k_len are padding
                keep = (kpos[None, :] < lens[1][:, None])[:, None, None]
                mask = keep if mask is None else mask & keep
            if qseg is not None:  # packed rows: a token sees only its own sequence
                keep = (qseg[:, :, None] == kseg[:, None, :])[:, None]
                mask = keep if mask is None else mask & keep
            if full_mask is not None:  # the mask's columns of this block's keys
                cols = jnp.take(full_mask, kpos, axis=3)
                if cols.dtype == jnp.bool_:
                    mask = cols if mask is None else mask & cols
                else:  # additive
                    s = s + cols.astype(jnp.float32)
            if mask is not None:
                s = jnp.where(mask, s, _NEG)
            # the running max is a shift the softmax cancels: no gradient flows through it
            # (exact; XLA:CPU at --xla_backend_optimization_level=0 gave NaN dq/dk through the
            # max's gradient with an additive mask)
            m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(-1)))
            p = jnp.exp(s - m_new[..., None])
            if mask is not None:  # a row with every key of this block masked adds nothing
                p = jnp.where(mask, p, 0.0)
            alpha = jnp.exp(m - m_new)
            den = den * alpha + p.sum(-1)  # the softmax's sum: before dropout
            if dropout:  # dropped probabilities, the kept ones scaled by 1 / (1 - p)
                rate, dims = dropout[0], dropout[1]
                keep = _keep_block(kd, dims, rate, b0, h0, b, h, qpos, kpos)
                p = jnp.where(keep, p * jnp.float32(1.0 / (1.0 - rate)), 0.0)
            vv = _expand_kv(v, h).astype(jnp.float32)
            acc = acc * alpha[..., None] + jnp.einsum("bhqk,bkhd->bhqd", p, vv)
            m = m_new
            if step + 1 < n_ring:
                moved = (k, v, kpos) if kseg is None else (k, v, kpos, kseg)
                moved = [jax.lax.ppermute(x, ring, perm) for x in moved]
                k, v, kpos = moved[:3]
                kseg = moved[3] if kseg is not None else None
        out = acc / jnp.where(den > 0, den, 1.0)[..., None]
        if lens:  # varlen: queries at or past q_len are padding, their output 0
            out = jnp.where((qpos[None, :] < lens[0][:, None])[:, None, :, None], out, 0.0)
        out = jnp.transpose(out, (0, 2, 1, 3)).astype(q.dtype)
        if a2a:  # back: [b, s, h/n, d] -> [b, s/n, h, d]
            out = jax.lax.all_to_all(out, a2a, 1, 2, tiled=True)
        return out

    return body


def _zigzag_order(n):
    """Chunk order of the zig-zag layout: device i holds chunks i and 2 * n - 1 - i."""
    return [c for i in range(n) for c in (i, 2 * n - 1 - i)]


def _to_zigzag(x, axes, n, dim):
    """Inside the region: device j's block of chunks 2j, 2j+1 (of 2n) becomes chunks j and
    2n-1-j (the zig-zag layout), by two ppermutes over the sequence ``axes``; nothing is
    gathered. Chunk c goes to device c (c < n) or 2n-1-c; device j gets its first chunk from
    the even stream when j is even, from the odd one when odd."""
    a, b = jnp.split(x, 2, axis=dim)
    dest = [c if c < n else 2 * n - 1 - c for c in range(2 * n)]
    ra = jax.lax.ppermute(a, axes, [(i, dest[2 * i]) for i in range(n)])
    rb = jax.lax.ppermute(b, axes, [(i, dest[2 * i + 1]) for i in range(n)])
    even = jax.lax.axis_index(axes) % 2 == 0
    return jnp.concatenate([jnp.where(even, ra, rb), jnp.where(even, rb, ra)], axis=dim)


def _from_zigzag(x, axes, n, dim):
    """The inverse of :func:`_to_zigzag`: chunks j, 2n-1-j back to their home device c // 2."""
    first, second = jnp.split(x, 2, axis=dim)
    even = jax.lax.axis_index(axes) % 2 == 0
    s0, s1 = jnp.where(even, first, second), jnp.where(even, second, first)
    home0 = [(j if j % 2 == 0 else 2 * n - 1 - j) // 2 for j in range(n)]
    home1 = [(2 * n - 1 - j if j % 2 == 0 else j) // 2 for j in range(n)]
    r0 = jax.lax.ppermute(s0, axes, list(enumerate(home0)))
    r1 = jax.lax.ppermute(s1, axes, list(enumerate(home1)))
    return jnp.concatenate([r0, r1], axis=dim)


def _make_attention(
    mesh, bax, a2a, ring, scale, causal, varlen, hax=None, extras=None, dropout_p=0.0
):
    """The JAX function (q, k, v, *extras) -> out: one shard_map over ``a2a + ring``, sequences
    split on those axes (ring major), the batch on ``bax`` and the heads on ``hax`` (tensor
    parallel: each device's heads, None: whole); the zig-zag reorder inside it when a causal
    ring runs. ``extras`` (a tuple of "lens", "segments", "mask", in that order; ``varlen`` is
    "lens") are the masks' inputs, Note [Context parallel masks]. ``dropout_p``: attention
    dropout, the seed (an int64 scalar, as the unsharded attention rule's) the last input."""
    extras = tuple(extras or ()) or (("lens",) if varlen else ())
    sizes = dict(mesh.shape)
    n_ring = int(np.prod([sizes[a] for a in ring]))
    n = n_ring * int(np.prod([sizes[a] for a in a2a]))
    seq_axes = tuple(a for a in mesh.axis_names if a in ring + a2a)
    seq = seq_axes[0] if len(seq_axes) == 1 else seq_axes
    spec, pos_spec = P(bax, seq, hax, None), P(seq)
    extra_specs = []
    for e in extras:
        if e == "lens":
            extra_specs += [P(bax), P(bax)]
        elif e == "segments":
            extra_specs += [P(bax, seq), P(bax, seq)]
        else:  # mask [b or 1, 1, sq, sk]: q's rows on the sequence axes, every key
            extra_specs.append(None)  # filled per call (its batch dim may broadcast)
    zigzag = causal and n_ring > 1

    def zigzagged(extras, dropout=None):
        """The body, with the zig-zag reorder in and out inside the region (ppermutes over the
        sequence axes: q, k, v, segments and mask rows stay split, never gathered)."""
        body = _body(a2a, ring, n_ring, scale, causal, extras, dropout)
        if not zigzag:
            return body

        def region(q, k, v, qpos, kpos, *rest):
            q, k, v = (_to_zigzag(x, seq_axes, n, 1) for x in (q, k, v))
            rest = list(rest)
            kd = [rest.pop()] if dropout else []
            if "segments" in extras:
                i = 2 if "lens" in extras else 0
                rest[i], rest[i + 1] = (_to_zigzag(x, seq_axes, n, 1) for x in rest[i : i + 2])
            if "mask" in extras:  # rows follow the queries; columns are picked by position
                rest[-1] = _to_zigzag(rest[-1], seq_axes, n, 2)
            return _from_zigzag(body(q, k, v, qpos, kpos, *rest, *kd), seq_axes, n, 1)

        return region

    # called with q, k, v alone it is the unmasked attention (as before the masks' inputs)
    bodies = {extras: zigzagged(extras), (): zigzagged(())}

    laid = NamedSharding(mesh, spec)

    def fwd(q, k, v, *rest):
        # inputs, results (and so the gradients) stay split on the sequence outside the region
        q, k, v = (jax.lax.with_sharding_constraint(x, laid) for x in (q, k, v))
        rest = list(rest)
        kd = []
        if dropout_p:  # the seed -> the key's data, replicated into the region
            kd = [jax.random.key_data(jax.random.key(rest.pop().astype(jnp.int64)))]
        specs, active = (list(extra_specs), extras) if rest else ([], ())
        if "mask" in active:
            mask = rest[-1]
            heads = hax if mask.shape[1] > 1 else None
            specs[-1] = P(bax if mask.shape[0] == q.shape[0] else None, heads, seq, None)
        qpos = jnp.arange(q.shape[1], dtype=jnp.int32)
        kpos = jnp.arange(k.shape[1], dtype=jnp.int32)
        if zigzag:  # the positions of the zig-zag layout (its reorder runs inside the region)
            order = np.array(_zigzag_order(n))
            c = q.shape[1] // (2 * n)
            qpos = kpos = qpos.reshape(2 * n, c)[order].reshape(-1)
        body = bodies[active]
        if dropout_p:
            dims = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
            body = zigzagged(active, (dropout_p, dims, bax, hax))
        out = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(spec, spec, spec, pos_spec, pos_spec, *specs, *([P()] * len(kd))),
            out_specs=spec,
            check_vma=False,
        )(q, k, v, qpos, kpos, *rest, *kd)
        return jax.lax.with_sharding_constraint(out, laid)

    return fwd
