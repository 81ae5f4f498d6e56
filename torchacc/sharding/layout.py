"""Shardings of a step's program in SPMD mode: what its inputs and results are laid out as.

Note [SPMD mode] is in torchacc/sharding/mesh.py. Here, for one program:

- every array argument keeps the sharding it has (an argument on another mesh or on a single
  device, say the result of ``call_jax``, is first moved onto the engine mesh, replicated), and the
  two scalar vectors are replicated;
- every result that overwrites a tensor's previous data (its storage's ``start``: a parameter, an
  optimizer moment, a running statistic) keeps that data's sharding, so state does not drift to
  another layout between steps (which would compile a second program and move data every step);
  a result the step creates (no previous data) takes the layout of the data it derives from
  (Note [A new result's layout]); other results are left to XLA's sharding propagation;
- both go into the program's key, and the argument shardings into a known step's launch key.

Note [A new result's layout]
A step creates results that belong to a parameter without overwriting it: its gradient (with
``zero_grad(set_to_none=True)``) and, at the first step, its optimizer moments (``zeros_like``,
then ``lerp``/``addcmul`` with the gradient). They must come out laid out like their parameter:
otherwise the next step reshards them into the update every step, and ZeRO-3 would hold them
whole (XLA cannot express the padded layout of Note [Padded shards] itself). What ties them to
their parameter is the program, not their shape: the optimizer combines the gradient, the moments
and the parameter elementwise into the parameter's update. So the program's values are grouped by
elementwise derivation: two values are in one group when an elementwise op (``torch.Tag.
pointwise``, a copy or cast, a ``*_like`` factory, ``zero_``/``fill_``, a ``_foreach_*`` op
element by element, a fused optimizer's list update index by index) reads one and writes the
other at the same shape. A new result takes:

1. the layout of the previous data of the state its group updates (the parameter an AdamW step
   overwrites, whatever layout the gradient argument came in: a gradient made by a backward-only
   program that XLA laid out), if that is one layout;
2. else the layout of the group's arguments, if that is one layout (``x * 2`` of a sharded input);
3. else none: XLA's sharding propagation picks one and JAX hands the result back laid out as
   XLA chose (``backward()`` alone: nothing in the program ties the gradient to its parameter).

A shape and dtype shared by chance decide nothing: under Megatron tensor parallelism ``q_proj``
and ``o_proj`` are both ``h x h``, split on other dimensions, and each gradient and moment keeps
its own parameter's split; a replicated norm weight's gradient stays replicated.

Note [Padded shards]
JAX lays an array out only if each sharded dimension divides evenly over its mesh axes, while
torch_xla pads (GPT-2's 50,257-row embedding over 4 devices). torchacc pads the same way: a tensor
sharded unevenly keeps its logical shape in its Value's desc, and its array is padded at the end
of each such dimension to the next multiple (the padding holds zeros, and nothing reads it). A
program slices padded arguments back to their logical shape on entry and pads a result that
keeps a padded tensor's layout on exit (``unpadded``); XLA fuses both into their neighbours.
``Value.array`` (a host read, ``call_jax``) gives the logical array; ``buf`` is the padded one.
"""

from __future__ import annotations

import jax
import torch

from torchacc.ir import TensorSlot
from torchacc.runtime import processes
from torchacc.sharding import mesh


def normalize(loose):
    """Lay a step's loose inputs out for one program: replicated data (and data on a single
    device, e.g. ``call_jax``'s results) moves onto the engine mesh, as JAX cannot mix a
    replicated layout of one mesh with splits of another in a program; data split over
    another mesh of the same devices in the same order stays as it is (JAX takes it); a split
    over the devices in another order moves onto the engine mesh when that mesh has its axes,
    else it is a ValueError naming both meshes."""
    engine = mesh.engine_mesh()
    names = dict(engine.shape)
    for v in loose:
        a = v.buf
        s = getattr(a, "sharding", None)
        named = isinstance(s, jax.sharding.NamedSharding)
        if named and s.mesh == engine:
            continue
        spec = s.spec if named else ()
        used = [n for e in spec if e is not None for n in (e if isinstance(e, tuple) else (e,))]
        if used and mesh.same_devices(s.mesh, engine):
            continue
        if any(names.get(n) != dict(s.mesh.shape)[n] for n in used):
            raise ValueError(
                f"torchacc SPMD: a tensor of shape {tuple(a.shape)} is sharded as {spec} over "
                f"mesh {dict(s.mesh.shape)} (devices {[d.id for d in s.mesh.devices.flat]}), "
                f"but the step runs on mesh {dict(engine.shape)} (devices "
                f"{[d.id for d in engine.devices.flat]}); use one mesh for a step's tensors"
            )
        target = jax.sharding.NamedSharding(engine, jax.sharding.PartitionSpec(*spec))
        if a.is_fully_addressable and not processes.spans_processes():
            v.buf = jax.device_put(a, target)
        else:
            v.buf = jax.jit(lambda x: x, out_shardings=target)(a)


def padded_shape(shape, sharding):
    """``shape`` with each dimension ``sharding`` splits rounded up to a multiple of its split
    (Note [Padded shards])."""
    sizes = dict(sharding.mesh.shape)
    out = []
    for n, entry in zip(shape, tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))):
        k = 1
        for axis in () if entry is None else entry if isinstance(entry, tuple) else (entry,):
            k *= sizes[axis]
        out.append(-(-n // k) * k)
    return tuple(out)


def plan(graph, outputs, starts):
    """``(argument shardings, result shardings, padded argument shapes, padded result shapes)``
    of ``graph``'s program (a shape entry is None where nothing is padded; results in the
    program's order, ``graph.out_order``)."""
    rep = mesh.replicated()
    arrays = graph.args()
    ins = (rep, rep, *[a.sharding for a in arrays])
    in_pads = tuple(
        tuple(a.shape) if tuple(a.shape) != tuple(v.desc[0]) else None
        for a, v in zip(arrays, graph.loose)
    )
    derived = None  # Note [A new result's layout], computed when a result needs it
    outs, out_pads = [], []
    for i in graph.out_order:  # the program's order of results (Note [Donation pairs])
        v = outputs[i]
        start = None if starts is None else starts[i]
        logical = tuple(v.desc[0])
        a = None if start is None else start.buf
        if start is None and _constrained(v):  # marked in the step: its constraint decides
            a = None
        elif getattr(a, "sharding", None) is None or tuple(start.desc[0]) != logical:
            a = None
            if logical:  # a scalar is replicated whatever the rule
                if derived is None:
                    derived = _derived_layouts(graph, outputs, starts)
                a = derived[i]
        if a is None:
            outs.append(None)
            out_pads.append(None)
        else:
            outs.append(a.sharding)
            out_pads.append(tuple(a.shape) if tuple(a.shape) != logical else None)
    return ins, tuple(outs), in_pads, tuple(out_pads)


def _derived_layouts(graph, outputs, starts):
    """Per output of ``graph``, the argument array whose layout it takes if it is new, or None
    (Note [A new result's layout])."""
    find = _groups(graph)
    updated, given = {}, {}  # group -> {(sharding, array shape, logical shape): array}
    for j, start in enumerate([None] * len(outputs) if starts is None else starts):
        a = None if start is None else start.buf
        if getattr(a, "sharding", None) is not None:
            group = updated.setdefault(find(graph.out_slots[j]), {})
            group[(a.sharding, tuple(a.shape), tuple(start.desc[0]))] = a
    for slot, v in enumerate(graph.inputs):
        a = v.buf
        if getattr(a, "sharding", None) is not None:
            group = given.setdefault(find(slot), {})
            group[(a.sharding, tuple(a.shape), tuple(v.desc[0]))] = a
    result = []
    for j, v in enumerate(outputs):
        group = find(graph.out_slots[j])
        found = updated.get(group) or given.get(group) or {}
        if len(found) == 1 and next(iter(found))[2] == tuple(v.desc[0]):
            result.append(next(iter(found.values())))
        else:
            result.append(None)
    return result


# elementwise ops without the pointwise tag: copies and casts (functional ``copy_``), and the ops
# that make or overwrite a tensor like their input (``zeros_like``, functional ``zero_``/``fill_``)
_COPIES = frozenset(
    [
        "aten::_to_copy",
        "aten::copy",
        "aten::detach",
        "aten::alias",
        "aten::lift_fresh_copy",
        "aten::zero",
        "aten::fill",
        "aten::zeros_like",
        "aten::ones_like",
        "aten::empty_like",
        "aten::full_like",
    ]
)
_elementwise_ops: dict = {}


def _elementwise(func):
    """Whether OpOverload ``func`` computes each output element from the same element of its
    same-shaped inputs."""
    known = _elementwise_ops.get(func)
    if known is None:
        known = isinstance(func, torch._ops.OpOverload) and (
            torch.Tag.pointwise in func.tags or func._schema.name in _COPIES
        )
        _elementwise_ops[func] = known
    return known


def _tensor_slots(template, found):
    """The TensorSlots in an OpEntry argument template, in order, appended to ``found``."""
    tp = type(template)
    if tp is TensorSlot:
        found.append(template)
    elif tp is list or tp is tuple:
        for x in template:
            _tensor_slots(x, found)
    elif tp is dict:
        for x in template.values():
            _tensor_slots(x, found)
    return found


def _groups(graph):
    """``find(slot)``: the group of a program slot (inputs, then each node's outputs: Graph's
    numbering) under elementwise derivation (Note [A new result's layout])."""
    parent = list(range(len(graph.inputs)))
    shape = [tuple(v.desc[0]) for v in graph.inputs]

    def find(x):
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    def join(out, slots):
        for s in slots:
            if shape[s] == shape[out]:
                parent[find(s)] = find(out)

    for node, in_ids in zip(graph.order, graph.key[1][1::2]):
        op = node.op
        base = len(parent)
        parent.extend(range(base, base + len(op.descs)))
        shape.extend(None if d is None else tuple(d[0]) for d in op.descs)
        func = op.key[0]
        kind = op.kind
        if type(kind) is tuple:  # several lists updated index by index (fused optimizers)
            lists = [
                [in_ids[t] for t in x]
                for x in [*op.args, *op.kwargs.values()]
                if type(x) in (list, tuple) and x and all(type(t) is TensorSlot for t in x)
            ]
            at = base
            for n in kind:
                for k in range(n):
                    if shape[at + k] is not None:
                        join(at + k, [ids[k] for ids in lists if len(ids) == n])
                at += n
        elif not isinstance(func, torch._ops.OpOverload):  # a batched _foreach_* node
            if len(op.key) > 1 and _elementwise(op.key[1]):
                for k, template in enumerate(op.args):
                    if shape[base + k] is not None:
                        join(base + k, [in_ids[t] for t in _tensor_slots(template, [])])
        elif _elementwise(func) and not op.rule.rng:
            ins = [in_ids[t] for t in _tensor_slots([op.args, op.kwargs], [])]
            for k, d in enumerate(op.descs):
                if d is not None:
                    join(base + k, ins)
    return find


def _constrained(v):
    """Whether pending Value ``v`` is a ``mark_sharding`` constraint (``torchacc::shard``)."""
    from torchacc.sharding import rules

    node = v.node
    return node is not None and node.op.rule.fn is rules.shard


def unpadded(program, graph, in_pads, out_pads):
    """``program`` taking padded arguments and giving padded results where the plan says
    (Note [Padded shards])."""
    if not any(in_pads) and not any(out_pads):
        return program
    logical_in = [v.desc[0] for v in graph.loose]
    logical_out = [graph.outputs[j].desc[0] for j in graph.out_order]

    def run(floats, ints, *arrays):
        arrays = [
            a if pad is None else a[tuple(slice(0, n) for n in shape)]
            for a, pad, shape in zip(arrays, in_pads, logical_in)
        ]
        results = program(floats, ints, *arrays)
        return [
            r if pad is None else jax.numpy.pad(r, [(0, p - n) for n, p in zip(shape, pad)])
            for r, pad, shape in zip(results, out_pads, logical_out)
        ]

    return run


def logical(array, shape):
    """The logical ``shape`` part of a possibly padded array (Note [Padded shards])."""
    if tuple(array.shape) == tuple(shape):
        return array
    return array[tuple(slice(0, n) for n in shape)]


def launch_key(loose):
    """The part of a known step's launch key that SPMD adds: its arguments' shardings."""
    if not mesh.is_spmd():
        return ()
    return tuple([(getattr(v.buf, "sharding", None), getattr(v.buf, "shape", None)) for v in loose])
