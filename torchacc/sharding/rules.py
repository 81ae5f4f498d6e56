"""Collective and sharding rules (lowering stage of the one engine).

- ``torchacc::shard`` -> ``jax.lax.with_sharding_constraint``. Note [SPMD mode]
  (torchacc/sharding/mesh.py): ``mark_sharding`` of a tensor whose value is still pending records
  this op; XLA's partitioner takes the constraint and propagates the rest. The sharding travels as
  a static string (part of the op's structural key) naming a ``NamedSharding`` kept in
  ``SHARDINGS`` by whoever recorded it (``torchacc.sharding.api``).
- ``torch.ops.torchacc_dist.*``: the collectives, custom ops with meta kernels whose rules are
  marked ``torchacc_collective``. They are ``jax.lax`` collectives over the axes of the manual
  region being lowered (``region_axes()``): the process axis of the job-wide mesh for per-process
  code, the axes a user's manual region names otherwise (Note [One mesh] in
  torchacc/sharding/__init__.py).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchacc.lowering.registry import register

_lib = torch.library.Library("torchacc", "FRAGMENT")
_lib.define("shard(Tensor x, str sharding) -> Tensor")
_lib.impl("shard", lambda x, sharding: torch.empty_like(x), "Meta")
shard_op = torch.ops.torchacc.shard.default

SHARDINGS: dict = {}  # name -> jax.sharding.NamedSharding


def name_sharding(sharding):
    """A stable static name for ``sharding`` (equal shardings get equal names)."""
    mesh = sharding.mesh
    devices = ",".join(str(d.id) for d in mesh.devices.flat)
    name = f"{mesh.devices.shape}{mesh.axis_names}[{devices}]{tuple(sharding.spec)}"
    SHARDINGS.setdefault(name, sharding)
    return name


@register(shard_op)
def shard(x, sharding):
    return jax.lax.with_sharding_constraint(x, SHARDINGS[sharding])


# --------------------------------------------------------------------------------------------
# the axes collectives run over while a rule is lowered

PROCESS_AXIS = (
    "process"  # = runtime.processes.AXIS (kept equal by hand: lowering cannot import runtime)
)
_axes = [(PROCESS_AXIS,)]


def region_axes():
    """The mesh axes of the manual region being lowered (a tuple of names)."""
    return _axes[-1]


def _ax():
    axes = _axes[-1]
    return axes[0] if len(axes) == 1 else axes


@contextlib.contextmanager
def lowering_region(axes):
    """Collectives lowered inside run over ``axes`` (the manual axes of a ``shard_map`` body)."""
    _axes.append(tuple(axes))
    try:
        yield
    finally:
        _axes.pop()


# --------------------------------------------------------------------------------------------
# custom ops: schema + meta kernel

_dist = torch.library.Library("torchacc_dist", "DEF")
# ``groups``: "" (every member of the region's axes) or sub-groups as "0,1;2,3" (see _groups)
_dist.define("all_reduce(Tensor[] xs, str op, float scale, bool scaled, str groups='') -> Tensor[]")
_dist.define("all_gather(Tensor x, int dim, int world, str groups='') -> Tensor")
_dist.define(
    "reduce_scatter(Tensor x, str op, float scale, bool scaled, int dim, int world, "
    "str groups='') -> Tensor"
)
_dist.define("broadcast(Tensor[] xs, int src, str groups='') -> Tensor[]")
_dist.define(
    "all_to_all(Tensor x, int split_dim, int concat_dim, int world, str groups='') -> Tensor"
)
_dist.define("collective_permute(Tensor x, str pairs) -> Tensor")

ops = torch.ops.torchacc_dist


def _meta_all_reduce(xs, op, scale, scaled, groups=""):
    return [x.new_empty(x.shape) for x in xs]


def _meta_all_gather(x, dim, world, groups=""):
    shape = list(x.shape)
    shape[dim] *= world
    return x.new_empty(shape)


def _meta_reduce_scatter(x, op, scale, scaled, dim, world, groups=""):
    shape = list(x.shape)
    shape[dim] //= world
    return x.new_empty(shape)


def _meta_broadcast(xs, src, groups=""):
    return [x.new_empty(x.shape) for x in xs]


def _meta_all_to_all(x, split_dim, concat_dim, world, groups=""):
    shape = list(x.shape)
    shape[split_dim] //= world
    shape[concat_dim] *= world
    return x.new_empty(shape)


for _name, _fn in (
    ("all_reduce", _meta_all_reduce),
    ("all_gather", _meta_all_gather),
    ("reduce_scatter", _meta_reduce_scatter),
    ("broadcast", _meta_broadcast),
    ("all_to_all", _meta_all_to_all),
    ("collective_permute", lambda x, pairs: x.new_empty(x.shape)),
):
    _dist.impl(_name, _fn, "Meta")


# --------------------------------------------------------------------------------------------
# lowering rules (traced inside shard_map over the process mesh)


def _collective(fn):
    fn.torchacc_collective = True  # sharding.manual.is_collective_graph looks for this
    return fn


def _as_reducible(x):
    """bool -> uint8 so the reductions apply; returns (array, undo)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8), lambda r: r.astype(jnp.bool_)
    return x, lambda r: r


def _scaled(r, scale):
    if not jnp.issubdtype(r.dtype, jnp.floating):
        return r
    wide = jnp.float32 if r.dtype in (jnp.float16, jnp.bfloat16) else r.dtype
    return (r.astype(wide) * scale.astype(wide)).astype(r.dtype)


def parse_groups(groups):
    """``"0,1;2,3"`` -> ``[[0, 1], [2, 3]]`` (``""`` -> None)."""
    if not groups:
        return None
    return [[int(i) for i in g.split(",")] for g in groups.split(";")]


def format_groups(groups):
    return ";".join(",".join(str(int(i)) for i in g) for g in groups)


def _group_tables(groups):
    """For sub-groups of the region's members: per member, its group's members (rows padded with
    the member itself: equal-sized groups need no padding) and its position in its group."""
    gs = parse_groups(groups)
    n = sum(len(g) for g in gs)
    size = max(len(g) for g in gs)
    members = np.zeros((n, size), np.int32)
    mask = np.zeros((n, n), bool)
    pos = np.zeros((n,), np.int32)
    for g in gs:
        for k, i in enumerate(g):
            members[i, : len(g)] = g
            members[i, len(g) :] = i
            mask[i, g] = True
            pos[i] = k
    return members, mask, pos


def _me():
    return jax.lax.axis_index(_ax())


def _grouped_reduce(x, op, groups):
    """``op`` over this member's group: every member's value (all_gather over the region's axes),
    masked to the group, reduced locally. Exact for sum/min/max as a reduction order differs."""
    _, mask, _ = _group_tables(groups)
    a, undo = _as_reducible(x)
    everyone = jax.lax.all_gather(a, _ax())  # (members, *shape)
    mine = jnp.asarray(mask)[_me()].reshape((-1,) + (1,) * a.ndim)
    if op in ("sum", "avg"):
        if x.dtype == jnp.bool_:
            r = jnp.max(jnp.where(mine, everyone, 0), axis=0)
        else:
            r = jnp.sum(jnp.where(mine, everyone, jnp.zeros_like(everyone)), axis=0, dtype=a.dtype)
        if op == "avg":
            r = r / jnp.asarray(mine.sum(), r.dtype)
    elif op in ("max", "or"):
        low = jnp.iinfo(a.dtype).min if jnp.issubdtype(a.dtype, jnp.integer) else -jnp.inf
        r = jnp.max(jnp.where(mine, everyone, jnp.asarray(low, a.dtype)), axis=0)
    elif op in ("min", "and"):
        high = jnp.iinfo(a.dtype).max if jnp.issubdtype(a.dtype, jnp.integer) else jnp.inf
        r = jnp.min(jnp.where(mine, everyone, jnp.asarray(high, a.dtype)), axis=0)
    elif op == "product":
        r = jnp.prod(jnp.where(mine, everyone, jnp.ones_like(everyone)), axis=0, dtype=a.dtype)
    else:
        raise ValueError(f"torchacc.distributed: unknown reduction {op!r}")
    return undo(r)


def _group_members(x, groups):
    """(group size, *x.shape): the values of this member's group, in group order."""
    members, _, _ = _group_tables(groups)
    everyone = jax.lax.all_gather(x, _ax())
    return jnp.take(everyone, jnp.asarray(members)[_me()], axis=0)


def _reduce_all(xs, op):
    """Reduce a list of arrays over the mesh with ``op``; one collective per kind of op."""
    pairs = [_as_reducible(x) for x in xs]
    arrays = [a for a, _ in pairs]
    if op == "sum":
        if any(x.dtype == jnp.bool_ for x in xs):  # a bool sum is an "or"
            out = [
                jax.lax.pmax(a, _ax()) if x.dtype == jnp.bool_ else jax.lax.psum(a, _ax())
                for a, x in zip(arrays, xs, strict=True)
            ]
        else:
            out = jax.lax.psum(arrays, _ax())
    elif op == "avg":
        n = jax.lax.axis_size(_ax())
        out = [r / jnp.asarray(n, r.dtype) for r in jax.lax.psum(arrays, _ax())]
    elif op in ("max", "or"):
        out = jax.lax.pmax(arrays, _ax())
    elif op in ("min", "and"):
        out = jax.lax.pmin(arrays, _ax())
    elif op == "product":
        out = []
        for a, x in zip(arrays, xs, strict=True):
            if x.dtype == jnp.bool_:
                out.append(jax.lax.pmin(a, _ax()))
            else:
                out.append(jnp.prod(jax.lax.all_gather(a, _ax()), axis=0, dtype=a.dtype))
    else:  # the helpers validate op names before recording
        raise ValueError(f"torchacc.distributed: unknown reduction {op!r}")
    return [undo(r) for r, (_, undo) in zip(out, pairs, strict=True)]


@register(ops.all_reduce.default)
@_collective
def _all_reduce_rule(xs, op, scale, scaled, groups=""):
    if groups:
        out = [_grouped_reduce(x, op, groups) for x in xs]
    else:
        out = _reduce_all(list(xs), op)
    return [_scaled(r, scale) for r in out] if scaled else out


@register(ops.all_gather.default)
@_collective
def _all_gather_rule(x, dim, world, groups=""):
    if groups:
        g = _group_members(x, groups)  # (world, *shape) -> concatenated along dim
        return jnp.concatenate(list(g), axis=dim)
    return jax.lax.all_gather(x, _ax(), axis=dim, tiled=True)


@register(ops.reduce_scatter.default)
@_collective
def _reduce_scatter_rule(x, op, scale, scaled, dim, world, groups=""):
    if groups:
        full = _grouped_reduce(x, op, groups)
        chunk = x.shape[dim] // world
        start = jnp.asarray(_group_tables(groups)[2])[_me()] * chunk
        r = jax.lax.dynamic_slice_in_dim(full, start, chunk, axis=dim)
    elif op in ("sum", "avg") and x.dtype != jnp.bool_:
        r = jax.lax.psum_scatter(x, _ax(), scatter_dimension=dim, tiled=True)
        if op == "avg":
            r = r / jnp.asarray(world, r.dtype)
    else:
        full = _reduce_all([x], op)[0]
        chunk = x.shape[dim] // world
        start = jax.lax.axis_index(_ax()) * chunk
        r = jax.lax.dynamic_slice_in_dim(full, start, chunk, axis=dim)
    return _scaled(r, scale) if scaled else r


_BITS = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


@register(ops.broadcast.default)
@_collective
def _broadcast_rule(xs, src, groups=""):
    # sum of (the source's bits, zeros elsewhere) over integer views: exact for every value;
    # with sub-groups, ``src`` is the position in each group of the member that sends
    if groups:
        members, _, _ = _group_tables(groups)
        sender = jnp.asarray(members)[_me(), src]
        return [jnp.take(jax.lax.all_gather(x, _ax()), sender, axis=0) for x in xs]
    me = jax.lax.axis_index(_ax()) == src
    bits, backs = [], []
    for x in xs:
        if x.dtype == jnp.bool_:
            bits.append(x.astype(jnp.int8))
            backs.append(lambda r: r.astype(jnp.bool_))
        elif jnp.issubdtype(x.dtype, jnp.complexfloating):
            bits.append(x)
            backs.append(lambda r: r)
        else:
            itype = _BITS[x.dtype.itemsize]
            bits.append(x if x.dtype == itype else jax.lax.bitcast_convert_type(x, itype))
            backs.append(
                lambda r, d=x.dtype, it=itype: r if d == it else jax.lax.bitcast_convert_type(r, d)
            )
    masked = [jnp.where(me, b, jnp.zeros_like(b)) for b in bits]
    return [back(r) for r, back in zip(jax.lax.psum(masked, _ax()), backs, strict=True)]


@register(ops.all_to_all.default)
@_collective
def _all_to_all_rule(x, split_dim, concat_dim, world, groups=""):
    if groups:
        g = _group_members(x, groups)  # member j's whole x; I take its block at my position
        pos = jnp.asarray(_group_tables(groups)[2])[_me()]
        chunk = x.shape[split_dim] // world
        blocks = [
            jax.lax.dynamic_slice_in_dim(g[j], pos * chunk, chunk, axis=split_dim)
            for j in range(world)
        ]
        return jnp.concatenate(blocks, axis=concat_dim)
    return jax.lax.all_to_all(x, _ax(), split_dim, concat_dim, tiled=True)


@register(ops.collective_permute.default)
@_collective
def _collective_permute_rule(x, pairs):
    # torch_xla's collective_permute / send / recv: one ppermute; a member no pair sends to
    # receives zeros
    perm = [tuple(p) for p in parse_groups(pairs)]
    return jax.lax.ppermute(x, _ax(), perm)


# --------------------------------------------------------------------------------------------
# manual regions of the user's code (torchacc/sharding/regions.py)

_lib.define("manual_region(Tensor[] args, str graph, str region) -> Tensor[]")
manual_region_op = torch.ops.torchacc.manual_region.default

REGIONS: dict = {}  # name -> Region


class Region:
    """A manual region's static part: its ``jax.sharding.Mesh``, the ``PartitionSpec`` of each
    argument and result, the manual axes and the results' global (shape, dtype)."""

    def __init__(self, mesh, in_specs, out_specs, axes, out_meta):
        self.mesh, self.axes = mesh, tuple(axes)
        self.in_specs, self.out_specs = tuple(in_specs), tuple(out_specs)
        self.out_meta = tuple(out_meta)
        devices = ",".join(str(d.id) for d in mesh.devices.flat)
        self.name = (
            f"{mesh.devices.shape}{mesh.axis_names}[{devices}]{self.axes}"
            f"{self.in_specs}{self.out_specs}{self.out_meta}"
        )


def add_region(region):
    return REGIONS.setdefault(region.name, region).name


def _manual_region_meta(args, graph, region):
    return [torch.empty(s, dtype=d, device="meta") for s, d in REGIONS[region].out_meta]


_lib.impl("manual_region", _manual_region_meta, "Meta")


def _region_fn(graph, region):
    """The region as a function of global arrays: ``jax.shard_map`` of the replayed graph."""
    from torchacc.lowering.region import GRAPHS

    r, g = REGIONS[region], GRAPHS[graph]

    def body(*xs):
        with lowering_region(r.axes):
            return tuple(g.run(list(xs)))

    manual = frozenset(r.axes)
    kw = {} if manual == frozenset(r.mesh.axis_names) else {"axis_names": manual}
    f = jax.shard_map(
        body, mesh=r.mesh, in_specs=r.in_specs, out_specs=r.out_specs, check_vma=False, **kw
    )
    return f


@register(manual_region_op)
def _manual_region(args, graph, region):
    return list(_region_fn(graph, region)(*args))


# The backward of a manual region (Note [Regions under autograd] in sharding/regions.py): the
# input gradients of the region's floating point arguments, JAX's transpose of the region's
# shard_map (a shard_map of the transposed body: a ppermute's transpose is the inverse ppermute,
# an all_gather's a reduce-scatter, ...). One gradient per argument; zeros for the others.
_lib.define("manual_region_vjp(Tensor[] args, Tensor[] cts, str graph, str region) -> Tensor[]")
manual_region_vjp_op = torch.ops.torchacc.manual_region_vjp.default
_lib.impl(
    "manual_region_vjp",
    lambda args, cts, graph, region: [torch.empty_like(a, device="meta") for a in args],
    "Meta",
)


def _floating(x):
    return jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.complexfloating)


@register(manual_region_vjp_op)
def _manual_region_vjp(args, cts, graph, region):
    f = _region_fn(graph, region)
    wrt = [i for i, a in enumerate(args) if _floating(a)]
    outs = [k for k, (_, d) in enumerate(REGIONS[region].out_meta) if d.is_floating_point]

    def differentiable(*xs):
        full = list(args)
        for i, x in zip(wrt, xs):
            full[i] = x
        results = f(*full)
        return tuple(results[k] for k in outs)

    _, pull = jax.vjp(differentiable, *[args[i] for i in wrt])
    grads = pull(tuple(cts[k] for k in outs))
    result = [jnp.zeros(jnp.shape(a), jnp.asarray(a).dtype) for a in args]
    for i, g in zip(wrt, grads):
        result[i] = g
    return result


# enable_manual_sharding: a tensor's block, a node that only a later disable_manual_sharding turns
# into a region (sharding/regions.py); computed on its own it is an error
_lib.define("manual_enter(Tensor x, str entry) -> Tensor")
manual_enter_op = torch.ops.torchacc.manual_enter.default
ENTRIES: dict = {}  # name -> (mesh, PartitionSpec, local shape)


def add_entry(mesh, spec, local):
    devices = ",".join(str(d.id) for d in mesh.devices.flat)
    name = f"{mesh.devices.shape}{mesh.axis_names}[{devices}]{tuple(spec)}{tuple(local)}"
    ENTRIES.setdefault(name, (mesh, spec, tuple(local)))
    return name


_lib.impl(
    "manual_enter",
    lambda x, entry: torch.empty(ENTRIES[entry][2], dtype=x.dtype, device="meta"),
    "Meta",
)


@register(manual_enter_op)
def _manual_enter(x, entry):
    raise ValueError(
        "torchacc: a tensor made by xs.enable_manual_sharding (a per-device block) is computed "
        "outside a manual region: end the region with xs.disable_manual_sharding before "
        "mark_step, and read only its result"
    )


class IrRegion:
    """A manual region made of recorded nodes (between enable_ and disable_manual_sharding): it
    replays them with their rules on the blocks, like a step's program (program/build.py)."""

    def __init__(self, nodes, inputs, out, out_meta, fill):
        self.fill = fill  # ir.graph.fill (passed in: the ir stage is above this one)
        self.nodes = nodes  # [(rule, args, kwargs, input refs, scalars, descs)]
        self.inputs = inputs  # refs of the region's arguments, in order
        self.out = out  # ref of the result
        self.out_meta = out_meta

    def run(self, arrays):
        fill = self.fill
        env = dict(zip(self.inputs, arrays))
        for k, (rule, args, kwargs, refs, scalars, descs) in enumerate(self.nodes):
            ins = [env[r] for r in refs]
            extra = {}
            if rule.out_meta:
                from torchacc.lowering.dtypes import jdtype

                extra["out"] = [None if d is None else (d[0], jdtype(d[2])) for d in descs]
            result = rule.fn(*fill(args, ins, scalars), **fill(kwargs, ins, scalars), **extra)
            results = list(result) if isinstance(result, (list, tuple)) else [result]
            from torchacc.lowering.dtypes import jdtype

            for i, (r, d) in enumerate(zip(results, descs)):
                if r is not None and d is not None:
                    r = jnp.asarray(r)
                    env[("node", k, i)] = r if r.dtype == jdtype(d[2]) else r.astype(jdtype(d[2]))
        return [env[self.out]]
