"""The sharding engine's API: meshes, partition specs and sharding tensors in SPMD mode.

Every front door (``torch_xla.distributed.spmd``, FSDPv2, ``torchacc.parallel``, ``accelerate``)
translates into these functions; none moves data or inserts collectives itself: a computed
tensor's array is resharded by JAX (``jax.device_put``), a pending one gets a sharding constraint
in the step (``sharding/rules.py``), and XLA's partitioner does the rest (Note [SPMD mode] in
torchacc/sharding/mesh.py).

A partition spec has one entry per tensor dimension: ``None`` (replicated along it), a mesh axis
name or index, or a tuple of them (the dimension split over several axes, major first).
"""

from __future__ import annotations

import jax
import numpy as np
import torch

from torchacc import metrics
from torchacc.engine import transfer
from torchacc.lazy.device import DEVICE_TYPE
from torchacc.runtime import processes
from torchacc.sharding import layout as program_sharding
from torchacc.sharding import mesh as runtime_mesh

_meshes: dict = {}


def use_spmd():
    """Switch SPMD mode on: the torchacc device becomes one virtual device over every device of
    the job. Sets ``XLA_USE_SPMD=1`` for child processes, as torch_xla does.

    Tensors that already exist (a model moved to the device, a step already run) are computed
    first and then laid out replicated over the engine mesh, so a notebook can try one device
    and then sharding. In a job of several processes each process joined JAX with its one device,
    so the switch must come before the first device use there (a RuntimeError says how)."""
    import os

    from torchacc.ir import live_storages

    if runtime_mesh.is_spmd():
        os.environ["XLA_USE_SPMD"] = "1"
        return
    live = [st for st in live_storages()]
    if live and processes.world_size() > 1 and not processes.wants_all_local_devices():
        raise RuntimeError(
            "use_spmd(): this process of a multi-process job already uses the device, with one "
            "device per process (JAX was joined that way and cannot add devices); call "
            "xr.use_spmd() at the start of the script, before the first tensor is moved to the "
            "device, or set XLA_USE_SPMD=1 in the job's environment"
        )
    if live:
        _move_onto_the_mesh(live)
    runtime_mesh.enable()
    if live:
        rep = runtime_mesh.replicated()
        for st in live:
            v = st.value
            if v.node is None and isinstance(v.array, jax.Array):
                v.buf = jax.device_put(v.array, rep)
        from torchacc.program import known

        known.spoil("SPMD mode was switched on")
    os.environ["XLA_USE_SPMD"] = "1"


def _move_onto_the_mesh(live):
    """Compute every pending tensor first (its step was recorded for one device)."""
    from torchacc.engine.execute import sync

    if any(st.value.node is not None for st in live):
        sync()


def is_spmd():
    return runtime_mesh.is_spmd()


devices = runtime_mesh.devices  # every device of the job, by id
local_devices = runtime_mesh.local_devices
job_mesh = runtime_mesh.job_mesh  # processes x local devices (Note [One mesh])
process_axes = runtime_mesh.process_axes
adopt_mesh = runtime_mesh.adopt_mesh  # a jax Mesh over every device becomes the engine mesh


def device_count():
    """Every device of the job (processes x local devices)."""
    return len(runtime_mesh.devices())


def local_device_count():
    return len(runtime_mesh.local_devices())


def ordinal(device):
    """A device's global ordinal: its position among every device of the job, by id."""
    return runtime_mesh.devices().index(device)


def jax_mesh(device_ids, mesh_shape, axis_names):
    """The ``jax.sharding.Mesh`` of global device ordinals ``device_ids`` laid out as
    ``mesh_shape`` (cached: equal meshes are one object)."""
    key = (
        tuple(int(i) for i in np.asarray(device_ids).reshape(-1)),
        tuple(mesh_shape),
        tuple(axis_names),
    )
    m = _meshes.get(key)
    if m is None:
        devices = runtime_mesh.devices()
        grid = np.array([devices[i] for i in key[0]], dtype=object).reshape(key[1])
        m = _meshes[key] = jax.sharding.Mesh(grid, key[2])
    return m


def _entry_names(entry, jmesh, call, shape, spec):
    names = []
    for axis in entry if isinstance(entry, tuple) else (entry,):
        if isinstance(axis, bool) or not isinstance(axis, (int, str)):
            raise ValueError(
                f"{call}: partition spec entry {axis!r} in {spec} for a tensor of shape {shape}: "
                "expected None, a mesh axis name or index, or a tuple of them"
            )
        if isinstance(axis, int):
            if not 0 <= axis < len(jmesh.axis_names):
                raise ValueError(
                    f"{call}: mesh axis {axis} in partition spec {spec} (tensor of shape {shape}) "
                    f"is out of range for a mesh of shape {dict(jmesh.shape)}"
                )
            axis = jmesh.axis_names[axis]
        elif axis not in jmesh.axis_names:
            raise ValueError(
                f"{call}: axis name {axis!r} in partition spec {spec} (tensor of shape {shape}) is "
                f"not an axis of the mesh {dict(jmesh.shape)}"
            )
        names.append(axis)
    return names


def named_sharding(jmesh, partition_spec, shape, call="mark_sharding"):
    """``NamedSharding`` of a tensor of ``shape`` split by ``partition_spec`` over ``jmesh``,
    validated (a ``ValueError`` names the tensor's shape, the spec and the mesh)."""
    spec = tuple(partition_spec)
    shape = tuple(shape)
    if len(spec) != len(shape):
        raise ValueError(
            f"{call}: partition spec {spec} has {len(spec)} entries for a tensor of rank "
            f"{len(shape)} (shape {shape}) on mesh {dict(jmesh.shape)}"
        )
    entries, seen = [], set()
    for entry in spec:
        if entry is None:
            entries.append(None)
            continue
        names = _entry_names(entry, jmesh, call, shape, spec)
        if seen.intersection(names):
            raise ValueError(
                f"{call}: mesh axis {sorted(seen.intersection(names))} used twice in partition "
                f"spec {spec} (tensor of shape {shape}, mesh {dict(jmesh.shape)})"
            )
        seen.update(names)
        entries.append(tuple(names) if len(names) > 1 else names[0])
    return jax.sharding.NamedSharding(jmesh, jax.sharding.PartitionSpec(*entries))


def _check_device(t, call):
    if not isinstance(t, torch.Tensor) or t.device.type != DEVICE_TYPE:
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{call}: expects a tensor on the torchacc device, got one on {where}")
    if not runtime_mesh.is_spmd():
        raise ValueError(
            f"{call}: SPMD mode is off; call torch_xla.runtime.use_spmd() (torchacc: "
            "torchacc.distributed.sharding.use_spmd()) at the start of the script"
        )


def set_data(t, array):
    """Make the torchacc tensor ``t`` hold the global ``array`` (its shape, possibly padded:
    Note [Padded shards]) as its new data, e.g. a loaded checkpoint's."""
    from torchacc.ir import Value, contiguous_desc
    from torchacc.lazy.mutation import assign
    from torchacc.program import known

    assign(t, Value(contiguous_desc(tuple(t.shape), t.dtype), array=array))
    known.spoil("a tensor's data was replaced")


def mark(t, sharding, call="mark_sharding"):
    """Lay ``t`` out as ``sharding`` (a NamedSharding from :func:`named_sharding`): a computed
    tensor's array is resharded now; a pending tensor gets a sharding constraint in its step."""
    from torchacc.lazy import mutation
    from torchacc.lazy.record import record_values, value_of
    from torchacc.lazy.tensor import LazyTensor
    from torchacc.sharding import rules

    _check_device(t, call)
    runtime_mesh.adopt_mesh(sharding.mesh)
    if not isinstance(t, LazyTensor):  # traced by torchacc.compile: a constraint in its graph
        return _constrain_traced(t, rules.name_sharding(sharding), rules.shard_op)
    value = value_of(t)
    if t._view is None and transfer.is_deferred(value):  # Note [Deferred uploads]
        metrics.counter_inc("VirtualDeviceUsage")  # torch_xla's name: the sharded upload
        value.upload(sharding, program_sharding.padded_shape(tuple(value.desc[0]), sharding))
    elif t._view is None and value.node is None and value.buf is not None:
        # a known step's launch is keyed on its inputs' shardings too (sharding/layout.py):
        # resharding an input (a batch every step) keeps the step known
        value.buf = _reshard(value, sharding)
    else:
        name = rules.name_sharding(sharding)
        constrained = record_values(rules.shard_op, (t, name), {})[0][0]
        mutation.assign(t, constrained)
    t._torchacc_sharding = sharding
    return t


class _Constrain(torch.autograd.Function):
    """``torchacc::shard`` with an identity gradient, for a step traced by the trace-once
    frontend (Note [Device tensors in a trace-once program] in torchacc/engine/handoff.py)."""

    @staticmethod
    def forward(ctx, x, name, op):
        return op(x, name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def mark_spec(t, mesh, spec, call="mark_sharding"):
    """``mark(t, named_sharding(mesh, spec, t.shape, call), call)``; also inside
    ``torch.compile`` (see :func:`constrain_traced`)."""
    if torch.compiler.is_dynamo_compiling():
        return constrain_traced(t, named_sharding, mesh, spec, tuple(t.shape), call)
    return mark(t, named_sharding(mesh, spec, tuple(t.shape), call), call)


def constrain_traced(t, build, *args):
    """``mark`` while dynamo traces a step (``torch.compile``): ``t`` becomes its value
    constrained to the sharding ``build(*args)`` returns (None: leave ``t`` as it is). Dynamo
    cannot trace JAX's Python, so it calls ``build`` once, at trace time, through
    :func:`_sharding_name` (``torch.compiler.assume_constant_result``: its arguments are passed
    as they are, guarded by identity) and the graph keeps the sharding's name as a constant of a
    ``torchacc::shard`` node (Note [torch.compile over torchacc tensors] in
    torchacc/dynamo/device_tensors.py)."""
    name = _sharding_name(build, *args)
    if name is None:
        return t
    return _constrain_traced(t, name, _shard_op())


def _sharding_name(build, *args):
    from torchacc.sharding import rules

    sharding = build(*args)
    if sharding is None:
        return None
    runtime_mesh.adopt_mesh(sharding.mesh)
    return rules.name_sharding(sharding)


# dynamo evaluates it at trace time (what torch.compiler.assume_constant_result sets; the
# decorator itself would import torch._dynamo with torchacc)
_sharding_name._dynamo_marked_constant = True


def _shard_op():
    from torchacc.sharding import rules

    return rules.shard_op


def _constrain_traced(t, name, op):
    """Mark a tensor of a step being traced (a fake tensor): it becomes its constrained value
    in place, so the rest of the step reads the constraint (a leaf that needs a gradient, a
    parameter, already enters the program with its sharding: nothing to record)."""
    if t.is_leaf and t.requires_grad:
        return t
    constrained = _Constrain.apply(t, name, op)
    if t.requires_grad:
        t.copy_(constrained)
    else:
        with torch.no_grad():
            t.copy_(constrained)
    return t


def _reshard(value, sharding):
    """``value``'s data laid out as ``sharding``, padded where a dimension does not divide
    (Note [Padded shards] in sharding/layout.py)."""
    array = value.buf
    logical = tuple(value.desc[0])
    padded = program_sharding.padded_shape(logical, sharding)
    if array.sharding == sharding and tuple(array.shape) == padded:
        return array
    if tuple(array.shape) == padded and not _spans_processes(sharding):
        return jax.device_put(array, sharding)
    if not runtime_mesh.same_devices(getattr(array.sharding, "mesh", sharding.mesh), sharding.mesh):
        # another device order: move the data onto the target's devices first (replicated)
        replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        array = jax.device_put(array, replicated)

    def relayout(a):
        a = a[tuple(slice(0, n) for n in logical)]
        return jax.numpy.pad(a, [(0, p - n) for n, p in zip(logical, padded)])

    return jax.jit(relayout, out_shardings=sharding)(array)


def _spans_processes(sharding):
    return len({d.process_index for d in sharding.mesh.devices.flat}) > 1


def clear(t):
    """Forget ``t``'s annotation: its data goes back to replicated."""
    if getattr(t, "_torchacc_sharding", None) is None:
        return t
    mark(t, runtime_mesh.replicated(), "clear_sharding")
    t._torchacc_sharding = None
    return t


def sharding_of(t):
    """The ``NamedSharding`` of ``t``'s data (its annotation while it is pending), or None."""
    from torchacc.lazy.record import value_of

    if not isinstance(t, torch.Tensor) or t.device.type != DEVICE_TYPE:
        return None
    value = value_of(t)
    if transfer.is_deferred(value):  # still on the host (Note [Deferred uploads]): it goes up
        return runtime_mesh.replicated()  # replicated unless a mark lays it out first
    if value.node is None and isinstance(value.buf, jax.Array):
        return value.buf.sharding
    mark = getattr(t, "_torchacc_sharding", None)
    if mark is None and value.node is not None:  # pending: a constraint it holds (say a .grad
        from torchacc.sharding import rules  # the autograd engine detached)

        args = value.node.op.args
        if value.node.op.rule.fn is rules.shard and len(args) == 2:
            return rules.SHARDINGS.get(args[1])
    return mark


def hlo_text(sharding, ndim):
    """``sharding`` in torch_xla's text form (``{devices=[2,1,2]0,2,1,3
    last_tile_dim_replicate}``, ``{replicated}``): device numbers are global ordinals."""
    if sharding is None or isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return ""
    hlo = sharding._to_xla_hlo_sharding(ndim)
    if hlo.is_replicated():
        return "{replicated}"
    ids = [ordinal(d) for d in sharding._device_assignment]  # any jax sharding (jit results)
    dims = ",".join(str(d) for d in hlo.tile_assignment_dimensions())
    devices = ",".join(str(ids[i]) for i in hlo.tile_assignment_devices())
    tail = " last_tile_dim_replicate" if hlo.replicate_on_last_tile_dim() else ""
    return f"{{devices=[{dims}]{devices}{tail}}}"


def local_shards(t):
    """This process's shards of ``t``: ``(cpu tensor, index, replica_id, ordinal)`` each, the
    index a tuple of slices into the global tensor (computes ``t`` first if it is pending)."""
    from torchacc.engine.execute import sync
    from torchacc.engine.transfer import read
    from torchacc.lazy.record import value_of

    value = value_of(t)
    if value.node is not None:
        sync()
        value = value_of(t)
    array = value.buf  # padded where the layout needs it (Note [Padded shards])
    shape = tuple(t.shape)
    out = []
    for s in sorted(array.addressable_shards, key=lambda s: s.device.id):
        index = []
        for sl, n, p in zip(s.index, shape, array.shape):
            start, stop, _ = sl.indices(p)
            index.append(slice(min(start, n), min(stop, n)))
        keep = tuple(slice(0, i.stop - i.start) for i in index)
        data = read(s.data, t.dtype)[keep]
        out.append((data, tuple(index), s.replica_id, ordinal(s.device)))
    return out


def _shard_bytes(arrays):
    """{ordinal: bytes} of this process's shards of ``arrays`` (each array counted once)."""
    total: dict = {}
    seen = set()
    for array in arrays:
        if not isinstance(array, jax.Array) or id(array) in seen:
            continue
        seen.add(id(array))
        for s in array.addressable_shards:
            k = ordinal(s.device)
            total[k] = total.get(k, 0) + s.data.nbytes
    return total


def per_device_bytes(tensors):
    """Bytes each device holds of ``tensors`` (computed torchacc tensors): {ordinal: bytes}."""
    from torchacc.lazy.record import value_of

    arrays = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE:
            value = value_of(t)
            arrays.append(transfer.stored(value))
    return _shard_bytes(arrays)


def live_bytes_per_device():
    """Bytes each device holds of every live computed torchacc tensor (SPMD mode): {ordinal:
    bytes}, padding included. What ``xm.get_memory_info`` reports as ``tensor_bytes``."""
    from torchacc.ir import live_storages

    return _shard_bytes([transfer.stored(st.value) for st in live_storages()])


def memory_report(model, optimizer=None):
    """Per device, the bytes of ``model``'s parameters, their gradients and ``optimizer``'s
    state: {"parameters": {ordinal: bytes}, "gradients": ..., "optimizer_state": ...}."""
    params = list(model.parameters())
    state = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": per_device_bytes(params),
        "gradients": per_device_bytes([p.grad for p in params]),
        "optimizer_state": per_device_bytes(state),
    }
