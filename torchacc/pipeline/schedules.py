"""The JAX half of pipeline parallel: GPipe and 1F1B as one ``jax.shard_map`` region over the
``pp`` mesh axis (Note [Pipeline stages on the pp axis] in torchacc/pipeline/__init__.py).

``make_step(plan)`` returns a pure JAX function ``(packed, shared, data, key) -> (loss, packed
grads, shared grads)``: a ``lax.scan`` over micro-batch ticks in which each device runs its stage
(``lax.switch`` on its ``pp`` index) and hands its boundary activations to the next stage (and,
in 1F1B, its input gradients to the previous one) with ``lax.ppermute``. Nothing here moves bytes
but JAX's collectives; the other mesh axes (dp, fsdp, tp) stay automatic (XLA's partitioner).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SCHEDULES = ("1f1b", "gpipe", "forward")  # "forward": the loss only, no gradients


@dataclass(frozen=True)
class Plan:
    """What a pipeline step needs, all static.

    ``stage_fns[k](params, shared, consts, bnd_in, data, key) -> list``: stage k's JAX
    function; it returns the boundary tensors it hands on (the last stage: ``[loss]``).
    ``shared``: parameters several stages read (replicated over pp); ``consts``: buffers.
    ``params[k]``: per parameter of stage k, ``(group, offset, shape)`` in its packed group.
    ``groups``: per packed group, ``(dtype, width)``: the array is ``[stages, width]``.
    ``boundaries[k]``: the ``(shape, dtype)`` of what stage k hands stage k + 1.
    """

    mesh: object
    axis: str
    n_stages: int
    n_micro: int
    stage_fns: tuple
    params: tuple
    groups: tuple
    boundaries: tuple
    schedule: str = "1f1b"
    remat: bool = False
    batch_axes: tuple = ()
    param_axis: str | None = None  # a mesh axis the packed groups are also split on (fsdp)
    # uniform stages (uniform.py): ``runner(plan) -> (run, buffers)`` replaces the lax.switch
    # runner and the flat buffers; ``seq_axis``: the automatic axis the batch's dim 1 lies on
    runner: object = None
    seq_axis: str | None = None


# ---------------------------------------------------------------------------------------------
# boundary buffers: each boundary's tensors, flattened by dtype, in one buffer per dtype


def _buffer_dtypes(plan):
    """Per boundary buffer ``(dtype, shape)``: one flat buffer per dtype, as wide as the widest
    boundary's tensors of that dtype."""
    sizes = {}
    for bnd in plan.boundaries:
        per = {}
        for shape, dtype in bnd:
            per[dtype] = per.get(dtype, 0) + math.prod(shape)
        for d, n in per.items():
            sizes[d] = max(sizes.get(d, 0), n)
    return tuple((d, (w,)) for d, w in sorted(sizes.items(), key=lambda kv: str(kv[0])))


def _pack(bnd, values, buf_dtypes):
    out = []
    for d, width in buf_dtypes:
        parts = [v.reshape(-1) for (s, dt), v in zip(bnd, values) if dt == d]
        n = sum(p.shape[0] for p in parts)
        parts.append(jnp.zeros((width[0] - n,), d))
        out.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
    return out


def _unpack(bnd, bufs, buf_dtypes):
    where = {d: i for i, (d, _) in enumerate(buf_dtypes)}
    offset = {d: 0 for d, _ in buf_dtypes}
    values = []
    for shape, dtype in bnd:
        n, o = math.prod(shape), offset[dtype]
        values.append(bufs[where[dtype]][o : o + n].reshape(shape))
        offset[dtype] = o + n
    return values


def _zero_bufs(buf_dtypes):
    return [jnp.zeros(w, d) for d, w in buf_dtypes]


def _manual(plan):
    """The region's manual axes, in the mesh's order."""
    names = {plan.axis, *plan.batch_axes, *([plan.param_axis] if plan.param_axis else [])}
    return tuple(a for a in plan.mesh.axis_names if a in names)


def _varying(tree, axes):
    """``tree``'s arrays typed as varying over ``axes`` (what every branch and carry of the
    region returns, so that their types agree under shard_map's checks)."""

    def one(x):
        kind = getattr(jax.typeof(x), "manual_axis_type", None)
        have = kind.varying if kind is not None else frozenset()
        missing = tuple(a for a in axes if a not in have)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(one, tree)


# ---------------------------------------------------------------------------------------------
# one device's stage


def _stage_runner(plan, buf_dtypes):
    """``run(s, local, shared, bufs, data, key) -> (out_bufs, loss)``: stage ``s`` (a traced
    index) on this device's packed parameters ``local``, as one ``lax.switch``."""
    last = plan.n_stages - 1

    def branch(k):
        def run(local, shared, consts, bufs, data, key):
            params = [
                local[g][o : o + math.prod(shape)].reshape(shape) for g, o, shape in plan.params[k]
            ]
            bnd_in = _unpack(plan.boundaries[k - 1], bufs, buf_dtypes) if k else []
            out = plan.stage_fns[k](params, shared, consts, bnd_in, data, key)
            if k == last:
                res = _zero_bufs(buf_dtypes), out[0].astype(jnp.float32).reshape(())
            else:
                res = _pack(plan.boundaries[k], out, buf_dtypes), jnp.zeros((), jnp.float32)
            return _varying(res, _manual(plan))

        return jax.checkpoint(run) if plan.remat else run

    branches = [branch(k) for k in range(plan.n_stages)]

    def run(s, local, shared, consts, bufs, data, key):
        return jax.lax.switch(s, branches, local, shared, consts, bufs, data, key)

    return run


def _micro(data, m):
    return [jax.lax.dynamic_index_in_dim(d, m, 0, keepdims=False) for d in data]


def _key(key, m, s):
    if key is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(key, m), s)


# ---------------------------------------------------------------------------------------------
# schedules


def _gpipe_losses(plan, run, buf_dtypes):
    """Per device: the sum of its micro-batch losses (only the last stage has any) after
    M + S - 1 forward ticks; the backward is JAX's (a reverse scan)."""
    S, M = plan.n_stages, plan.n_micro
    fwd_perm = [(i, i + 1) for i in range(S - 1)]

    def body(local, shared, consts, data, key):
        s = jax.lax.axis_index(plan.axis)
        # per-device values from here, so that the backward's sums over devices (the transpose
        # of this cast) run once, here, not inside a stage's branch
        local, shared = _varying((local, shared), _manual(plan))

        def tick(carry, t):
            bufs, acc = carry
            m = t - s
            valid = (m >= 0) & (m < M)
            mc = jnp.clip(m, 0, M - 1)
            out, loss = run(s, local, shared, consts, bufs, _micro(data, mc), _key(key, mc, s))
            acc = acc + jnp.where(valid, loss, 0.0)
            bufs = [jax.lax.ppermute(b, plan.axis, fwd_perm) for b in out]
            return (bufs, acc), None

        init = _varying((_zero_bufs(buf_dtypes), jnp.zeros((), jnp.float32)), _manual(plan))
        (_, acc), _ = jax.lax.scan(tick, init, jnp.arange(M + S - 1))
        return acc.reshape(1)

    return body


def _one_f_one_b(plan, run, buf_dtypes, scale):
    """Per device, tick t: the forward of micro-batch t - s, then the backward of micro-batch
    t - 2 (S - 1) + s (recomputing its forward from the stashed stage input); activations go
    to s + 1 and input gradients to s - 1 by ppermute. At most min(M, 2 S - 1) stage inputs are
    stashed per device, whatever M."""
    S, M = plan.n_stages, plan.n_micro
    K = min(M, 2 * S - 1)
    fwd_perm = [(i, i + 1) for i in range(S - 1)]
    bwd_perm = [(i + 1, i) for i in range(S - 1)]
    last = S - 1

    def body(local, shared, consts, data, key):
        s = jax.lax.axis_index(plan.axis)
        zeros = _zero_bufs(buf_dtypes)
        axes = _manual(plan)
        floats = [i for i, (d, _) in enumerate(buf_dtypes) if jnp.issubdtype(d, jnp.floating)]
        # per-device values from here: each tick's VJP gives this device's own gradient (no
        # implicit psum); the sums over devices run once, after the loop
        local, shared = _varying((local, shared), axes)

        def tick(carry, t):
            fbufs, bbufs, stash, g_local, g_shared, acc = carry
            # forward of micro-batch t - s
            mf = t - s
            fvalid = (mf >= 0) & (mf < M)
            mfc = jnp.clip(mf, 0, M - 1)
            out, loss = run(s, local, shared, consts, fbufs, _micro(data, mfc), _key(key, mfc, s))
            acc = acc + jnp.where(fvalid, loss, 0.0)
            slot = mfc % K
            stash = [
                jax.lax.dynamic_update_index_in_dim(
                    st,
                    jnp.where(fvalid, b, jax.lax.dynamic_index_in_dim(st, slot, 0, False)),
                    slot,
                    0,
                )
                for st, b in zip(stash, fbufs)
            ]
            # backward of micro-batch t - 2 (S - 1) + s
            mb = t - 2 * (S - 1) + s
            bvalid = (mb >= 0) & (mb < M)
            mbc = jnp.clip(mb, 0, M - 1)
            x_in = [jax.lax.dynamic_index_in_dim(st, mbc % K, 0, False) for st in stash]
            data_b, key_b = _micro(data, mbc), _key(key, mbc, s)

            def f(lp, sp, xf):  # differentiable in the float buffers only
                xb = list(x_in)
                for i, x in zip(floats, xf):
                    xb[i] = x
                return run(s, lp, sp, consts, xb, data_b, key_b)

            _, pull = jax.vjp(f, local, shared, [x_in[i] for i in floats])
            seed = jnp.where(bvalid & (s == last), scale, 0.0).astype(jnp.float32)
            out_cot = [jnp.zeros(w, d) for d, w in buf_dtypes]
            for i, b in zip(floats, bbufs):
                out_cot[i] = jnp.where(bvalid, b, jnp.zeros_like(b))
            cot = _varying((out_cot, seed), axes)
            dl, dsh, dx = pull(cot)
            g_local = [g + jnp.where(bvalid, d, 0).astype(g.dtype) for g, d in zip(g_local, dl)]
            g_shared = [g + jnp.where(bvalid, d, 0).astype(g.dtype) for g, d in zip(g_shared, dsh)]
            fbufs = [jax.lax.ppermute(b, plan.axis, fwd_perm) for b in out]
            bbufs = [jax.lax.ppermute(d, plan.axis, bwd_perm) for d in dx]
            return (fbufs, bbufs, stash, g_local, g_shared, acc), None

        init = _varying(
            (
                zeros,
                [zeros[i] for i in floats],
                [jnp.zeros((K, *w), d) for d, w in buf_dtypes],
                [jnp.zeros_like(x) for x in local],
                [jnp.zeros_like(x) for x in shared],
                jnp.zeros((), jnp.float32),
            ),
            _manual(plan),
        )
        carry, _ = jax.lax.scan(tick, init, jnp.arange(M + 2 * (S - 1)))
        _, _, _, g_local, g_shared, acc = carry
        return acc.reshape(1), g_local, g_shared

    return body


def make_step(plan):
    """The pipeline step: ``(packed, shared, data, key) -> (loss, packed grads, shared
    grads)``. ``packed``: one ``[stages, width]`` array per group; ``shared``: parameters every
    stage may read (replicated over pp; their gradients are summed over the stages); ``data``:
    the batch's tensors (model inputs, then output_fn's), batch first; ``key``: a PRNG key or
    None. The loss is the mean of the micro-batches' losses.

    The region is manual over ``pp``, the batch axes (each device runs its share of every
    micro-batch) and ``param_axis`` (each packed row split on it, gathered before the loop and
    its gradient reduce-scattered after it); other mesh axes stay automatic. No collective runs
    inside a stage's branch: the stages' devices take different branches."""
    if plan.schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {plan.schedule!r}")
    if plan.runner is not None:
        run, buf_dtypes = plan.runner(plan)
    else:
        buf_dtypes = _buffer_dtypes(plan)
        run = _stage_runner(plan, buf_dtypes)
    mesh, axis, M = plan.mesh, plan.axis, plan.n_micro
    batch = tuple(plan.batch_axes)
    fsdp = plan.param_axis
    manual = frozenset({axis, *batch, *([fsdp] if fsdp else [])})
    n_batch = math.prod(mesh.shape[a] for a in batch)
    every = (axis, *[a for a in mesh.axis_names if a in manual and a != axis])
    bspec = batch if len(batch) != 1 else batch[0]
    bspec = bspec or None

    def data_specs(data):
        return [P(None, bspec) for _ in data]

    def micro_batches(data):
        out = [d.reshape(M, d.shape[0] // M, *d.shape[1:]) for d in data]
        if plan.seq_axis:  # the sequence (dim 1 of the batch) stays split on its axis
            n = mesh.shape[plan.seq_axis]
            out = [
                jax.lax.with_sharding_constraint(
                    d, NamedSharding(mesh, P(None, bspec, plan.seq_axis))
                )
                if d.ndim >= 3 and d.shape[2] % n == 0
                else d
                for d in out
            ]
        return out

    def gather(packed):  # this device's stage row, whole
        rows = [x[0] for x in packed]
        if fsdp:
            rows = [jax.lax.all_gather(r, fsdp, tiled=True) for r in rows]
        return rows

    def region(body, out_specs, data):
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(axis, fsdp), P(), P(), data_specs(data), P()),
            out_specs=out_specs,
            axis_names=manual,
        )

    scale = 1.0 / (M * n_batch)

    if plan.schedule in ("gpipe", "forward"):
        body = _gpipe_losses(plan, run, buf_dtypes)

        def local_body(packed, shared, consts, data, key):
            return body(gather(packed), shared, consts, data, key)

        def step(packed, shared, consts, data, key):
            data = micro_batches(data)
            losses = region(local_body, P(every), data)

            def total(packed, shared):
                return losses(packed, shared, consts, data, key).sum() * scale

            if plan.schedule == "forward":
                return total(packed, shared)
            loss, (gp, gs) = jax.value_and_grad(total, argnums=(0, 1))(packed, shared)
            return loss, gp, gs

        return step

    body = _one_f_one_b(plan, run, buf_dtypes, scale)
    others = tuple(a for a in batch if a != fsdp)

    def local_body(packed, shared, consts, data, key):
        acc, g_local, g_shared = body(gather(packed), shared, consts, data, key)
        if others:
            g_local = [jax.lax.psum(g, others) for g in g_local]
        if fsdp:
            g_local = [jax.lax.psum_scatter(g, fsdp, tiled=True) for g in g_local]
        g_shared = [jax.lax.psum(g, tuple(manual)) for g in g_shared]
        return acc, [g[None] for g in g_local], g_shared

    def step(packed, shared, consts, data, key):
        data = micro_batches(data)
        fused = region(local_body, (P(every), P(axis, fsdp), P()), data)
        losses, gp, gs = fused(packed, shared, consts, data, key)
        return losses.sum() * scale, gp, gs

    return step


def stage_bytes(plan):
    """Bytes of packed parameters each device holds (one stage's row of every group)."""
    return sum(w * np.dtype(d).itemsize for d, w in plan.groups)
