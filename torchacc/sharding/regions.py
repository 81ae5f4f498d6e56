"""Manual regions of the user's code: torch_xla's ``_shard_map`` / ``xs.shard_map`` on the one
engine (Note [One mesh] in torchacc/sharding/__init__.py).

``shard_map(func, mesh, in_specs, out_specs)(*args)`` traces ``func`` once per signature on
fake tensors of the *local* shapes (each argument's shape divided along the mesh axes its spec
names) and records one ``torchacc::manual_region`` node: its rule is ``jax.shard_map`` over the
mesh's axes, replaying the traced graph with the rules. Collectives ``func`` calls (``xm.*``,
``torchacc.sharding.collectives``) run over the region's axes: the rules read the axes of the
region being lowered (``rules.region_axes()``), and while ``func`` is traced the helpers count the
region's members instead of the job's processes. One program per step, nothing of torchacc's own
partitions or moves data: XLA lays the arguments out as the specs say and runs the body per device.

Tensors ``func`` closes over become replicated arguments (lifted as in Note [Traced regions]).
Gradients flow through a region: Note [Regions under autograd].

``enable_manual_sharding`` / ``disable_manual_sharding`` make the same node from ops recorded one
by one: the enable records a ``torchacc::manual_enter`` block (local shape), the disable collects
the nodes recorded since that descend from it and replays them as the region's body
(``rules.IrRegion``); values read in between that do not descend from a block are replicated
arguments. The blocks still held by tensors stop being pending (they have no global meaning).
Gradients flow through such a region too: Note [Regions under autograd].
"""

from __future__ import annotations

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchacc.lazy import region as traced_regions
from torchacc.lazy.tensor import LazyTensor
from torchacc.sharding import api, collectives, rules

_cache: dict = {}  # (func, signature, region) -> Traced


class _Shape:
    """A stand-in the tracer makes its fakes from: a shape and a dtype."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


def _jax_mesh(mesh):
    if hasattr(mesh, "get_jax_mesh"):  # torch_xla's xs.Mesh
        return mesh.get_jax_mesh()
    if hasattr(mesh, "axis_names") and hasattr(mesh, "devices"):  # a jax.sharding.Mesh
        return mesh
    raise ValueError(f"shard_map: mesh must be an xs.Mesh or a jax.sharding.Mesh, got {mesh!r}")


def _spec(jmesh, spec, shape, call):
    """The validated jax ``PartitionSpec`` of ``spec`` for a tensor of ``shape`` (None: every
    dimension replicated) and the local shape it gives."""
    if spec is None:
        spec = (None,) * len(shape)
    sharding = api.named_sharding(jmesh, spec, shape, call)
    sizes = dict(jmesh.shape)
    local = []
    for n, entry in zip(shape, tuple(sharding.spec) + (None,) * len(shape)):
        k = 1
        for axis in () if entry is None else entry if isinstance(entry, tuple) else (entry,):
            k *= sizes[axis]
        if n % k:
            raise ValueError(
                f"{call}: partition spec {tuple(spec)} does not divide a tensor of shape "
                f"{tuple(shape)}: a dimension of size {n} splits over {k} devices of mesh "
                f"{sizes}"
            )
        local.append(n // k)
    return sharding.spec, tuple(local)


def _global(jmesh, spec, local, call):
    sizes = dict(jmesh.shape)
    spec = tuple(spec) + (None,) * (len(local) - len(tuple(spec)))
    if len(spec) != len(local):
        raise ValueError(
            f"{call}: output spec {spec} has {len(spec)} entries for a result of rank "
            f"{len(local)} (local shape {tuple(local)})"
        )
    out = []
    for n, entry in zip(local, spec):
        k = 1
        for axis in () if entry is None else entry if isinstance(entry, tuple) else (entry,):
            k *= sizes[axis]
        out.append(n * k)
    return tuple(out)


def shard_map(func, mesh, in_specs, out_specs):
    """torch_xla's ``_shard_map(func, mesh, input_specs, output_specs)``: ``func`` runs on each
    device's block of its arguments (a manual region over every axis of ``mesh``); its results'
    blocks form the outputs as ``out_specs`` say. A spec is a partition spec (axis names or
    indices, None for a replicated dimension) or None (replicated)."""
    call = "shard_map"
    jmesh = _jax_mesh(mesh)
    axes = tuple(jmesh.axis_names)
    size = int(np.prod([jmesh.shape[a] for a in axes]))

    def run(*args):
        flat, spec_tree = tree_flatten(args)
        tensors = [v for v in flat if isinstance(v, torch.Tensor)]
        specs = list(in_specs) if isinstance(in_specs, (list, tuple)) else [in_specs]
        if len(specs) != len(tensors):
            raise ValueError(
                f"{call}: {len(specs)} input specs for {len(tensors)} tensor arguments"
            )
        for t in tensors:
            if type(t) is not LazyTensor:
                raise ValueError(
                    f"{call}: expects tensors on the torchacc device, got a {t.device} tensor "
                    f"of shape {tuple(t.shape)}"
                )
        jspecs, locals_ = [], []
        for t, s in zip(tensors, specs):
            js, local = _spec(jmesh, s, tuple(t.shape), call)
            jspecs.append(js)
            locals_.append(local)
        where = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        sig = (func, spec_tree, tuple(zip(locals_, (t.dtype for t in tensors))), repr(jspecs))
        sig = (sig, tuple(repr(v) for v in flat if not isinstance(v, torch.Tensor)), id(jmesh))
        traced = _cache.get(sig)
        if traced is None:

            def body(*ts):
                full = list(flat)
                for i, t in zip(where, ts):
                    full[i] = t
                collectives._regions.append(collectives._Region(axes, size))
                try:
                    return func(*tree_unflatten(full, spec_tree))
                finally:
                    collectives._regions.pop()

            stand_ins = [_Shape(s, t.dtype) for s, t in zip(locals_, tensors)]
            traced = traced_regions.trace(body, stand_ins, f"shard_map({_name(func)})")
            _cache[sig] = traced
        graph = traced_regions.ops.GRAPHS[traced.key]
        out_list = _out_specs(out_specs, len(graph.out_meta))
        if len(out_list) != len(graph.out_meta):
            raise ValueError(
                f"{call}: {len(out_list)} output specs for {len(graph.out_meta)} results of "
                f"{_name(func)}"
            )
        out_jspecs, out_meta = [], []
        for s, (local, dtype) in zip(out_list, graph.out_meta):
            s = (None,) * len(local) if s is None else tuple(s)
            gshape = _global(jmesh, s, local, call)
            js, _ = _spec(jmesh, s, gshape, call)
            out_jspecs.append(js)
            out_meta.append((gshape, dtype))
        closures = list(traced.closures)
        from jax.sharding import PartitionSpec

        region = rules.add_region(
            rules.Region(
                jmesh,
                [*jspecs, *[PartitionSpec() for _ in closures]],
                out_jspecs,
                axes,
                out_meta,
            )
        )
        outs = _call([*tensors, *closures], traced.key, region)
        leaves = list(traced.out_consts)
        for i, t in zip(traced.out_pos, outs):
            leaves[i] = t
        return tree_unflatten(leaves, traced.out_spec)

    return run


# Note [Regions under autograd]
# A region called on tensors that require grad is one autograd node (``_RegionCall``): its
# backward records ``torchacc::manual_region_vjp`` (sharding/rules.py), whose rule is JAX's vjp of
# the region's ``shard_map``: the transposed region (a ppermute's transpose is the inverse
# ppermute, a psum's cotangent is psum'ed, an all_gather's transpose is a reduce-scatter), over
# the same mesh and axes, recomputing the forward inside the backward's program. Only floating
# point arguments get gradients; a replicated argument (a closure, a None spec) gets the sum of
# the per-device gradients, as a replicated input of a per-device function should.
#
# A region built with enable_/disable_manual_sharding is the same node, so it gets the same
# backward; what it needs is the region's arguments as the tensors autograd knows. The ops in
# between run on blocks that have no global meaning, so torch's own autograd graph through them
# is never used (the blocks are made without grad). The tensor each enable split is kept with its
# block; the tensors that require grad and that ops read while a region is open (a weight, or an
# activation computed before the region) are noted by a TorchFunctionMode active only then
# (``_ReadsInRegion``: nothing on the per-op path otherwise), by the Value each read. At the
# disable, an argument whose tensor still holds the Value the region read is passed as that
# tensor, so the region's ``_RegionCall`` node connects to its autograd history; any other
# argument is a fresh tensor of its Value, as before (no gradient: it did not require one).


class _RegionCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, key, region, *tensors):
        ctx.key, ctx.region = key, region
        ctx.save_for_backward(*tensors)
        return tuple(rules.manual_region_op(list(tensors), key, region))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        tensors = ctx.saved_tensors
        metas = rules.REGIONS[ctx.region].out_meta
        device = tensors[0].device
        cts = [
            torch.zeros(s, dtype=d, device=device) if g is None else g
            for g, (s, d) in zip(grads, metas)
        ]
        outs = rules.manual_region_vjp_op(list(tensors), cts, ctx.key, ctx.region)
        keep = [t.is_floating_point() or t.is_complex() for t in tensors]
        return (None, None, *[g if k else None for k, g in zip(keep, outs)])


def _call(tensors, key, region):
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_RegionCall.apply(key, region, *tensors))
    return rules.manual_region_op(tensors, key, region)


def _out_specs(out_specs, n):
    """``out_specs`` as one spec per result: a list of specs, or one spec for one result."""
    if out_specs is None:
        return [None] * n
    items = list(out_specs) if isinstance(out_specs, (list, tuple)) else [out_specs]
    is_list = all(isinstance(s, (list, tuple)) or s is None for s in items) and len(items) == n
    if is_list and (n != 1 or isinstance(items[0], (list, tuple)) or items[0] is None):
        return items
    return [tuple(items)]


def _name(func):
    return getattr(func, "__name__", type(func).__name__)


# --------------------------------------------------------------------------------------------
# enable_manual_sharding / disable_manual_sharding: a region made of ops recorded one by one


def enable_manual_sharding(t, partition_spec, mesh):
    """torch_xla's ``xs.enable_manual_sharding``: ``t``'s per-device block (a tensor of the
    local shape) that the ops up to ``disable_manual_sharding`` work on, per device. The region is
    formed when it ends: ``disable_manual_sharding`` turns the ops recorded in between into one
    ``torchacc::manual_region`` node (``rules.IrRegion``)."""
    call = "enable_manual_sharding"
    if type(t) is not LazyTensor:
        raise ValueError(f"{call}: expects a tensor on the torchacc device, got {t.device}")
    from torchacc.lazy.record import value_of

    jmesh = _jax_mesh(mesh)
    spec, local = _spec(jmesh, partition_spec, tuple(t.shape), call)
    with torch.no_grad():  # Note [Regions under autograd]: the region's node has the backward
        block = rules.manual_enter_op(t, rules.add_entry(jmesh, spec, local))
    # collectives called on the blocks run over the mesh's axes until the region ends
    axes = tuple(jmesh.axis_names)
    collectives._regions.append(collectives._Region(axes, np.prod([jmesh.shape[a] for a in axes])))
    if not _open[0]:
        _reads.clear()
        _mode[0] = _ReadsInRegion()
        _mode[0].__enter__()
    _open[0] += 1
    if t.requires_grad:
        _reads[id(value_of(block).node)] = t
    return block


_open = [0]  # regions begun by enable_manual_sharding and not ended yet
# while a region is open (Note [Regions under autograd]): id(Value read) -> the tensor that
# requires grad which held it, and id(enter node) -> the tensor it split
_reads: dict = {}
_mode = [None]


class _ReadsInRegion(TorchFunctionMode):
    """Notes the tensors that require grad which ops read while a region begun by
    ``enable_manual_sharding`` is open (Note [Regions under autograd])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torchacc.lazy.record import value_of

        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, LazyTensor) and t.requires_grad:
                _reads[id(value_of(t))] = t
        return func(*args, **kwargs)


def _close_regions():
    """Every region begun by enable_manual_sharding has ended: its collectives' axes and the
    mode that notes reads go."""
    while _open[0]:
        collectives._regions.pop()
        _open[0] -= 1
    if _mode[0] is not None:
        mode, _mode[0] = _mode[0], None
        mode.__exit__(None, None, None)


def in_manual_region(t):
    """Whether ``t`` is computed from a block of an open ``enable_manual_sharding`` region."""
    from torchacc.lazy.record import value_of

    if not _open[0] or type(t) is not LazyTensor:
        return False
    seen, todo = set(), [value_of(t)]
    while todo:
        n = todo.pop().node
        if n is None or id(n) in seen:
            continue
        if n.op.rule.fn is rules._manual_enter:
            return True
        seen.add(id(n))
        todo.extend(n.inputs)
    return False


def disable_manual_sharding(t, partition_spec, full_shape, mesh):
    """torch_xla's ``xs.disable_manual_sharding``: the global tensor of ``full_shape`` whose
    per-device blocks (laid out by ``partition_spec``) are ``t``, computed from the blocks
    ``enable_manual_sharding`` gave. Every other tensor read in between is an argument of the
    region, replicated. A ``full_shape`` that ``t``'s shape and the spec do not give is a
    ValueError."""
    from torchacc.lazy.record import fresh, value_of

    call = "disable_manual_sharding"
    if type(t) is not LazyTensor:
        raise ValueError(f"{call}: expects a tensor on the torchacc device, got {t.device}")
    jmesh = _jax_mesh(mesh)
    full_shape = tuple(int(n) for n in full_shape)
    spec, local = _spec(jmesh, partition_spec, full_shape, call)
    if local != tuple(t.shape):
        raise ValueError(
            f"{call}: full_shape {full_shape} split by {tuple(partition_spec)} over mesh "
            f"{dict(jmesh.shape)} gives blocks of shape {local}, but the tensor's block has shape "
            f"{tuple(t.shape)}"
        )
    out_value = value_of(t)
    inside = {}  # id(node) -> bool: descends from an enter

    def is_inside(v):
        n = v.node
        if n is None:
            return False
        k = id(n)
        if k not in inside:
            inside[k] = n.op.rule.fn is rules._manual_enter or any(is_inside(u) for u in n.inputs)
        return inside[k]

    if not is_inside(out_value):
        raise ValueError(
            f"{call}: the tensor of shape {tuple(t.shape)} is not computed from a tensor of "
            "enable_manual_sharding"
        )
    nodes, seen = [], set()

    def collect(v):
        n = v.node
        if n is None or id(n) in seen or not is_inside(v) or n.op.rule.fn is rules._manual_enter:
            return
        seen.add(id(n))
        for u in n.inputs:
            collect(u)
        nodes.append(n)

    collect(out_value)
    nodes.sort(key=lambda n: n.seq)
    index = {id(n): k for k, n in enumerate(nodes)}
    args, refs_of_args, specs = [], {}, []
    sources = []  # per argument, the tensor that requires grad it came from, or None

    def ref(v):
        n = v.node
        if n is not None and id(n) in index:
            return ("node", index[id(n)], v.index)
        if n is not None and n.op.rule.fn is rules._manual_enter:
            key = ("enter", id(n))
            if key not in refs_of_args:
                entry = rules.ENTRIES[next(a for a in n.op.args if isinstance(a, str))]
                if entry[0] != jmesh:
                    raise ValueError(f"{call}: the region's tensors use different meshes")
                refs_of_args[key] = ("arg", len(args))
                args.append(n.inputs[0])
                sources.append(_reads.get(id(n)))
                specs.append(entry[1])
            return refs_of_args[key]
        key = ("outside", id(v))
        if key not in refs_of_args:  # read in the region, computed outside it: replicated
            refs_of_args[key] = ("arg", len(args))
            args.append(v)
            sources.append(_reads.get(id(v)))
            from jax.sharding import PartitionSpec

            specs.append(PartitionSpec())
        return refs_of_args[key]

    steps = []
    for n in nodes:
        if n.op.rule.rng:
            raise ValueError(f"{call}: random ops inside a manual region are not supported")
        refs = [ref(u) for u in n.inputs]
        steps.append((n.op.rule, n.op.args, n.op.kwargs, refs, list(n.scalars), n.op.descs))
    out_ref = ref(out_value)
    from torchacc.ir.graph import fill

    region_graph = rules.IrRegion(
        steps, [("arg", i) for i in range(len(args))], out_ref, ((local, t.dtype),), fill
    )
    key = "manual-" + _digest(steps, out_ref, specs, local)
    traced_regions.ops.GRAPHS.setdefault(key, region_graph)
    region = rules.add_region(
        rules.Region(jmesh, specs, [spec], tuple(jmesh.axis_names), [(full_shape, t.dtype)])
    )
    _close_regions()
    tensors = [t if t is not None and value_of(t) is v else fresh(v) for v, t in zip(args, sources)]
    _reads.clear()
    result = _call(tensors, key, region)[0]
    _retire_blocks(is_inside)
    return result


def _retire_blocks(is_inside):
    """The region's per-device blocks still held by tensors (the enable's result, intermediate
    results) have no global meaning: they stop being pending, so a mark_step does not compute
    them (reading one afterwards is an error naming the region)."""
    from torchacc.ir import Value, live_storages
    from torchacc.program import known

    for st in live_storages():
        v = st.value
        if v.node is not None and is_inside(v):
            st.value = Value(v.desc)
    known.spoil("a manual region ended (disable_manual_sharding)")


def _digest(steps, out_ref, specs, local):
    import hashlib

    h = hashlib.sha256()
    for rule, args, kwargs, refs, scalars, descs in steps:
        h.update(repr((rule.name, args, kwargs, refs, scalars, descs)).encode())
    h.update(repr((out_ref, [tuple(s) for s in specs], local)).encode())
    return h.hexdigest()[:32]
