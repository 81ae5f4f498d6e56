"""Shardings of a step's program in SPMD mode: what its inputs and results are laid out as.

Note [SPMD mode] is in torchacc/sharding/mesh.py. Here, for one program:

- every array argument keeps the sharding it has (an argument on another mesh or on a single
  device, say the result of ``call_jax``, is first moved onto the engine mesh, replicated), and the
  two scalar vectors are replicated;
- every result that overwrites a tensor's previous data (its storage's ``start``: a parameter, an
  optimizer moment, a running statistic) keeps that data's sharding, so state does not drift to
  another layout between steps (which would compile a second program and move data every step);
  a result the step creates (no previous data) with the shape and dtype of a sharded argument
  takes that argument's layout (a parameter's gradient, optimizer state made by ``zeros_like``:
  ZeRO-3 keeps them sharded like their parameter, and XLA cannot express the padded layout of
  Note [Padded shards] itself); other results are left to XLA's sharding propagation;
- both go into the program's key, and the argument shardings into a known step's launch key.

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
    like = {}  # (logical shape, dtype) -> the first sharded argument of it
    for a, v in zip(arrays, graph.loose):
        if any(e is not None for e in a.sharding.spec):
            like.setdefault((tuple(v.desc[0]), v.desc[2]), a)
    outs, out_pads = [], []
    for i in graph.out_order:  # the program's order of results (Note [Donation pairs])
        v = outputs[i]
        start = None if starts is None else starts[i]
        logical = tuple(v.desc[0])
        a = None if start is None else start.buf
        if start is None and _constrained(v):  # marked in the step: its constraint decides
            a = None
        elif getattr(a, "sharding", None) is None or tuple(start.desc[0]) != logical:
            a = like.get((logical, v.desc[2])) if start is None else None
        if a is None:
            outs.append(None)
            out_pads.append(None)
        else:
            outs.append(a.sharding)
            out_pads.append(tuple(a.shape) if tuple(a.shape) != logical else None)
    return ins, tuple(outs), in_pads, tuple(out_pads)


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
