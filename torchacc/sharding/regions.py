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
No autograd through a region (run it under ``torch.no_grad()`` or on tensors that need none).
"""

from __future__ import annotations

import numpy as np
import torch
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
        outs = rules.manual_region_op([*tensors, *closures], traced.key, region)
        leaves = list(traced.out_consts)
        for i, t in zip(traced.out_pos, outs):
            leaves[i] = t
        return tree_unflatten(leaves, traced.out_spec)

    return run


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
