"""``torch_xla._XLAC`` on torchacc: the C-extension calls that scripts and tests really make.

Implemented: syncing (``_xla_sync_multi``, ``_xla_sync_live_tensors``, ``_xla_step_marker``,
``_xla_wait_device_ops``), devices (``_xla_get_default_device``, ``_xla_get_all_devices``,
``_xla_real_devices``, ``_xla_device_kind``, ``_xla_memory_info``, ``_xla_tensors_from_aten``),
tensor ids and the pending graph as text or HLO (``_xla_get_tensor_id``,
``_get_xla_tensors_text``, ``_get_xla_tensors_hlo``), RNG seed, mat-mul precision, the metric
and counter calls behind ``torch_xla.debug.metrics`` (``_xla_increment_counter`` too), and the
internals torch_xla's own tests call: ``_xla_dot_general`` (recorded like any op),
``_set_allow_execution``, ``_init_computation_client``, ``_get_git_revs``, tensor reports and debug
info, ``_unsafe_buffer_pointer``, and the flags torchacc keeps without acting on
(``_xla_set_enable_alias_with_buffer_donor_config``: torchacc always donates what no live tensor
holds; ``_set_ir_debug``). Any other name raises an error that is both ``NotImplementedError``
(with the reason) and ``AttributeError`` (so ``hasattr`` stays False).
"""

from __future__ import annotations

import itertools

import torch

import torchacc
from torchacc.lazy.device import DEVICE_TYPE
from torchacc.torch_xla import _xlac_lowering as lowering  # noqa: F401  (LoweringContext)
from torchacc.torch_xla._api import differs, not_implemented, not_implemented_class
from torchacc.torch_xla._xlac_lowering import _get_graph_hash  # noqa: F401
from torchacc.torch_xla._xlac_metrics import (  # noqa: F401  (the metrics calls)
    _clear_xla_counters,
    _clear_xla_metrics,
    _get_executed_fallback_ops,
    _short_xla_metrics_report,
    _xla_counter_names,
    _xla_counter_value,
    _xla_increment_counter,
    _xla_metric_data,
    _xla_metric_names,
    _xla_metrics_report,
)
from torchacc.torch_xla._xlac_preemption import (  # noqa: F401  (the preemption sync point)
    _activate_preemption_sync_manager,
    _deactivate_preemption_sync_manager,
    _sync_point_reached,
)
from torchacc.torch_xla._xlac_text import (  # noqa: F401  (the IR and HLO text calls)
    _desc_text,
    _get_xla_tensors_hlo,
    _get_xla_tensors_text,
    _op_text,
    _values,
)


class XLACNotImplementedError(NotImplementedError, AttributeError):
    """A ``torch_xla._XLAC`` name torchacc does not provide."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise XLACNotImplementedError(
        f"torch_xla._XLAC.{name}: not implemented by torchacc (it has no torch_xla C++ lazy tensor "
        "core); the implemented _XLAC calls are listed in torchacc/torch_xla/_XLAC.py"
    )


# --- steps and devices ------------------------------------------------------------------------


@differs("syncs everything pending (one program), which includes the tensors")
def _xla_sync_multi(tensors, devices=(), wait=True, sync_xla_data=True):
    """Compute ``tensors``: torchacc syncs everything pending (one program), which includes them."""
    torchacc.sync(wait=wait)


def _xla_sync_live_tensors(device="", devices=(), wait=True):
    torchacc.sync(wait=wait)


def _xla_step_marker(device="", devices=(), wait=True):
    from torchacc.torch_xla.core import xla_model as xm

    xm.mark_step(wait=wait)


def _xla_wait_device_ops(devices=()):
    torchacc.wait_device_ops()


def _xla_get_default_device():
    return str(torchacc.device())


def _xla_get_all_devices():
    from torchacc.torch_xla.core import xla_model as xm

    return xm.xla_real_devices()


def _xla_real_devices(devices=None):
    from torchacc.torch_xla.core import xla_model as xm

    return xm.xla_real_devices(devices)


def _xla_device_kind(device=""):
    return torchacc.jax_device().device_kind


def _xla_memory_info(device=""):
    from torchacc.torch_xla.core import xla_model as xm

    return xm.get_memory_info(device)


def _xla_runtime_is_initialized():
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


def _xla_tensors_from_aten(tensors, devices=None, shardings=None):
    dev = torchacc.device()
    return [t.to(dev) for t in tensors]


# --- tensors and the pending graph ------------------------------------------------------------

_ids = itertools.count(1)
_ID_ATTR = "_torchacc_xla_tensor_id"


def _xla_get_tensor_id(tensor):
    """A unique id for ``tensor`` (stable for its lifetime)."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != DEVICE_TYPE:
        raise RuntimeError(f"_xla_get_tensor_id: expected a torchacc tensor, got {tensor!r}")
    tid = getattr(tensor, _ID_ATTR, None)
    if tid is None:
        tid = next(_ids)
        setattr(tensor, _ID_ATTR, tid)
    return tid


# --- RNG and precision -------------------------------------------------------------------------


def _xla_get_rng_seed(device=""):
    from torchacc.torch_xla.core import xla_model as xm

    return xm.get_rng_state()


def _xla_set_rng_seed(seed, device=""):
    from torchacc.torch_xla.core import xla_model as xm

    xm.set_rng_state(seed)


def _xla_set_mat_mul_precision(precision):
    from torchacc.torch_xla import backends

    backends.set_mat_mul_precision(precision)


def _xla_get_mat_mul_precision():
    from torchacc.torch_xla import backends

    return backends.get_mat_mul_precision()


def _xla_set_use_full_mat_mul_precision(use_full_mat_mul_precision=True):
    _xla_set_mat_mul_precision("highest" if use_full_mat_mul_precision else "default")


# --- internals torch_xla's tests call ----------------------------------------------------------


def _xla_dot_general(lhs, rhs, dimension_numbers, preferred_element_type=None):
    """XLA's DotGeneral on torchacc tensors, recorded as ordinary ops (permute, reshape, bmm).

    ``dimension_numbers`` is ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))`` (the
    batch pair may be empty); the result's dimensions are batch, lhs free, rhs free."""
    contract = dimension_numbers[0]
    batch = dimension_numbers[1] if len(dimension_numbers) > 1 and dimension_numbers[1] else ()
    lc, rc = [list(d) for d in contract]
    lb, rb = ([list(d) for d in batch]) if batch else ([], [])
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(f"_xla_dot_general: unpaired dimension numbers {dimension_numbers}")
    if preferred_element_type is not None:
        lhs, rhs = lhs.to(preferred_element_type), rhs.to(preferred_element_type)
    lf = [d for d in range(lhs.dim()) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.dim()) if d not in rc and d not in rb]
    for a, b in zip(lc + lb, rc + rb):
        if lhs.shape[a] != rhs.shape[b]:
            raise ValueError(
                f"_xla_dot_general: lhs dim {a} ({lhs.shape[a]}) != rhs dim {b} ({rhs.shape[b]}) "
                f"for shapes {tuple(lhs.shape)} and {tuple(rhs.shape)}"
            )

    def size(t, dims):
        n = 1
        for d in dims:
            n *= t.shape[d]
        return n

    batch_shape = [lhs.shape[d] for d in lb]
    left = lhs.permute(*lb, *lf, *lc).reshape(size(lhs, lb), size(lhs, lf), size(lhs, lc))
    right = rhs.permute(*rb, *rc, *rf).reshape(size(rhs, rb), size(rhs, rc), size(rhs, rf))
    out = torch.bmm(left, right)
    return out.reshape(*batch_shape, *[lhs.shape[d] for d in lf], *[rhs.shape[d] for d in rf])


def _set_allow_execution(allow):
    """``False``: launching any program raises (torch_xla's guard for compiled regions)."""
    from torchacc.engine import execute

    execute.allow_execution[0] = bool(allow)


def _init_computation_client():
    torchacc.jax_device()  # starts JAX's backend; raises if the platform cannot start


def _get_git_revs():
    from torchacc.torch_xla import __version__

    return {"torch": torch.version.git_version, "torch_xla": __version__}


_flags = {"alias_with_buffer_donor": False, "ir_debug": False}


@differs("kept, changes nothing: torchacc donates every input buffer no live tensor holds")
def _xla_set_enable_alias_with_buffer_donor_config(enable):
    _flags["alias_with_buffer_donor"] = bool(enable)


def _xla_get_enable_alias_with_buffer_donor_config():
    return _flags["alias_with_buffer_donor"]


@differs("kept, changes nothing: torchacc's op sites are TORCHACC_DEBUG=1")
def _set_ir_debug(enable):
    _flags["ir_debug"] = bool(enable)


def _get_ir_debug():
    return _flags["ir_debug"]


def _xla_get_auto_sharding():
    """False: XLA's auto-sharding pass is never on in torchacc (``xs.auto_policy`` raises)."""
    return False


def _xla_tensors_report(nodes_threshold=0, device=""):
    """Live torchacc tensors and how many hold pending (unsynced) values."""
    from torchacc.ir import live_storages

    storages = list(live_storages())
    pending = sum(st.value.node is not None for st in storages)
    return (
        f"TensorsReport (torchacc)\n  live storages: {len(storages)}\n"
        f"  with pending values: {pending}\n"
    )


def _spmd_full_to_shard_shape(tensor):
    """The per-device block of ``tensor`` laid out by its sharding: the start of a manual region
    over its mesh (``xs.enable_manual_sharding`` with the tensor's own partition spec)."""
    import jax

    from torchacc.sharding import api as engine
    from torchacc.sharding import regions

    sharding = engine.sharding_of(tensor)
    if not isinstance(sharding, jax.sharding.NamedSharding) or not _get_xla_sharding_spec(tensor):
        raise RuntimeError(
            f"_spmd_full_to_shard_shape: the tensor of shape {tuple(tensor.shape)} has no "
            "sharding; xs.mark_sharding it first"
        )
    spec = tuple(sharding.spec) + (None,) * (tensor.dim() - len(sharding.spec))
    return regions.enable_manual_sharding(tensor, spec, sharding.mesh)


def _spmd_shard_to_full_shape(tensor, sharding, full_shape, dtype):
    """The global tensor of ``full_shape`` made of the per-device blocks ``tensor`` laid out as
    ``sharding`` (``xs.Mesh.get_op_sharding``): the end of the manual region
    (``xs.disable_manual_sharding``)."""
    import jax

    from torchacc.sharding import regions

    named = getattr(sharding, "named_sharding", None)
    if not isinstance(named, jax.sharding.NamedSharding):
        raise RuntimeError(
            "_spmd_shard_to_full_shape: the sharding must come from xs.Mesh.get_op_sharding, "
            f"got {type(sharding).__name__}"
        )
    if not regions.in_manual_region(tensor):
        raise RuntimeError(
            f"_spmd_shard_to_full_shape: the tensor of shape {tuple(tensor.shape)} is not a "
            "block of a manual region (_spmd_full_to_shard_shape / xs.enable_manual_sharding)"
        )
    full_shape = tuple(full_shape)
    spec = tuple(named.spec) + (None,) * (len(full_shape) - len(named.spec))
    out = regions.disable_manual_sharding(tensor, spec, full_shape, named.mesh)
    return out if dtype is None or out.dtype == dtype else out.to(dtype)


def _get_xla_tensor_debug_info(tensor):
    """torch_xla's debug text of a tensor: its id, device, shape, sharding (``ShardingSpec``),
    whether it is pending and, for data, where it lives (``XLAShardedData`` in SPMD mode: the
    sharding and the number of shards)."""
    from torchacc.engine import transfer
    from torchacc.sharding import api as engine

    (value,) = _values([tensor])
    spec = _get_xla_sharding_spec(tensor) or "None"
    shape = _desc_text(value.desc)
    # in SPMD mode every tensor is on torch_xla's one virtual device
    device = "SPMD:0" if engine.is_spmd() else tensor.device
    if transfer.is_deferred(value):  # still on the host (Note [Deferred uploads])
        size = list(value.desc[0])
        return (
            "\n".join(
                [
                    "XLATensor {",
                    f"TensorID: {_xla_get_tensor_id(tensor)}",
                    f"Device: {device}",
                    f"XLA Shape: {shape}",
                    f"ShardingSpec: {spec}",
                    "IR: None",
                    "XLAData: None",
                    f"Tensor on host: with size {size}",
                ]
            )
            + "\n}\n"
        )
    lines = [
        "XLATensor {",
        f"TensorID: {_xla_get_tensor_id(tensor)}",
        f"Device: {device}",
        f"XLA Shape: {shape}",
        f"ShardingSpec: {spec}",
        f"ValueHolder: {'pending IR node' if value.node is not None else 'device data'}",
        f"IR: {'xla::device_data' if value.node is None else _op_text(value.node.op.rule.name)}",
        "Tensor on host: None",
    ]
    array = value.buf if value.node is None else None
    sharding = getattr(array, "sharding", None)
    if sharding is not None:
        if engine.is_spmd():
            lines += [
                "XLAShardedData: ",
                "  Data Device: SPMD:0",
                f"  Data Shape: {shape}",
                f"  OpSharding: {engine.hlo_text(sharding, tensor.dim()) or '{replicated}'}",
                f"  NumShards: {len(sharding.device_set)}",
            ]
        else:
            lines += ["XLAData: ", f"  Data Device: {tensor.device}", f"  Data Shape: {shape}"]
    return "\n".join(lines) + "\n}\n"


def _get_xla_tensor_dimension_size(tensor, dim):
    return torch.tensor(tensor.shape[dim], dtype=torch.int32, device=tensor.device)


def _unsafe_buffer_pointer(tensor):
    """The device address of ``tensor``'s buffer (computed first if pending)."""
    from torchacc.lazy.record import value_of

    _values([tensor])
    if value_of(tensor).node is not None:
        torchacc.sync(wait=True)
    value = value_of(tensor)
    if value.buf is None or type(value.buf) is tuple:
        raise RuntimeError(
            "_unsafe_buffer_pointer: the tensor has no buffer of its own (donated, or a piece of "
            "a packed buffer, Note [Packed state])"
        )
    return value.buf.unsafe_buffer_pointer()


_DONATION = (
    "marking a live tensor's buffer for donation is not implemented: torchacc donates every input "
    "buffer that no live tensor holds, at each sync"
)
_set_buffer_donation = not_implemented("torch_xla._XLAC._set_buffer_donation", _DONATION)
_get_buffer_donation = not_implemented("torch_xla._XLAC._get_buffer_donation", _DONATION)

_NO_SPMD = (
    "torch_xla's C++ sharding objects: torchacc shards through JAX NamedShardings "
    "(xs.Mesh.named_sharding, xs.mark_sharding; _get_xla_sharding_spec prints the text form)"
)
OpSharding = not_implemented_class("torch_xla._XLAC.OpSharding", _NO_SPMD)
XlaShardingSpec = not_implemented_class("torch_xla._XLAC.XlaShardingSpec", _NO_SPMD)


# --- SPMD ----------------------------------------------------------------------------------------


def _ensure_xla_coordinator_initialized(global_rank, world_size, master_addr, master_port=None):
    """torch_xla starts its distributed runtime's coordinator here; torchacc's process joins the
    JAX multi-process runtime from torchrun's environment when it starts (torchacc/runtime/
    processes.py), so this only checks that the job it joined is the one described."""
    from torchacc.runtime import processes

    processes.maybe_initialize()
    have = processes.world_size() if processes.is_initialized() else 1
    if int(world_size) != have:
        raise RuntimeError(
            f"_ensure_xla_coordinator_initialized(world_size={world_size}): this process runs in "
            f"a job of {have} process(es); launch it with torchrun --nproc_per_node {world_size}"
        )


def _is_xla_coordinator_initialized():
    return True


def _get_xla_sharding_spec(tensor):
    """``tensor``'s sharding in torch_xla's text form (``{devices=[2,1,2]0,2,1,3
    last_tile_dim_replicate}``, ``{replicated}``); ``""`` when it has none (uploaded data that no
    ``mark_sharding`` laid out, as torch_xla says; a program's replicated result is
    ``{replicated}``)."""
    from torchacc.sharding import api as sharding

    t = getattr(tensor, "global_tensor", tensor)
    if not sharding.is_spmd():
        return ""
    text = sharding.hlo_text(sharding.sharding_of(t), t.dim())
    mark = getattr(t, "_torchacc_sharding", False)  # False: never marked, None: cleared
    if text == "{replicated}" and not mark:
        from torchacc.lazy.transfer import is_upload

        if mark is None or is_upload(t):  # cleared, or uploaded and never marked
            return ""
    return text


def _global_tensor_from_cpu_shards(shards, op_sharding, global_shape=None):
    """A device tensor laid out as ``op_sharding`` (``Mesh.get_op_sharding``) from one CPU shard
    per device of this process, in device-ordinal order: every shard has the shape of a (padded)
    tile; ``global_shape`` (default: the tiles put together) may leave padding off the end of a
    dimension (Note [Padded shards]). Any other shape, or a wrong number of shards, is a
    ``RuntimeError`` naming it."""
    import jax

    from torchacc.engine.transfer import device_array_on
    from torchacc.ir import Value, contiguous_desc
    from torchacc.lazy.record import fresh
    from torchacc.sharding import api as engine

    named = getattr(op_sharding, "named_sharding", None)
    if not isinstance(named, jax.sharding.NamedSharding):
        raise TypeError(
            "_global_tensor_from_cpu_shards: op_sharding must come from xs.Mesh.get_op_sharding, "
            f"got {type(op_sharding).__name__}"
        )
    devices = sorted(named.addressable_devices, key=engine.ordinal)
    shards = list(shards)
    call = "_global_tensor_from_cpu_shards"
    if len(shards) != len(devices):
        raise RuntimeError(f"{call}: {len(shards)} shards for the {len(devices)} devices here")
    shape = tuple(shards[0].shape)
    if any(tuple(x.shape) != shape or x.dtype != shards[0].dtype for x in shards):
        raise RuntimeError(
            f"{call}: shards differ in shape or dtype: {[tuple(x.shape) for x in shards]}"
        )
    if all(e is None for e in named.spec):  # replicated: any rank
        named = jax.sharding.NamedSharding(named.mesh, jax.sharding.PartitionSpec())
    elif len(named.spec) != len(shape):
        raise RuntimeError(f"{call}: shards of rank {len(shape)} for a sharding of {named.spec}")
    tiles = named.shard_shape(tuple(len(devices) * n for n in shape))  # per-dim split counts
    parts = [len(devices) * n // t for n, t in zip(shape, tiles)]
    padded = tuple(n * k for n, k in zip(shape, parts))
    logical = padded if global_shape is None else tuple(global_shape)
    if len(logical) != len(shape) or any(-(-g // k) != n for g, k, n in zip(logical, parts, shape)):
        raise RuntimeError(
            f"{call}: global shape {logical} does not fit {len(shards)} shards of shape {shape} "
            f"split {parts} ways (padded global shape {padded})"
        )
    arrays = [device_array_on(x.contiguous(), d) for x, d in zip(shards, devices)]
    array = jax.make_array_from_single_device_arrays(padded, named, arrays)
    return fresh(Value(contiguous_desc(logical, shards[0].dtype), array=array))


def _get_xla_sharding_type(tensor):
    """torch_xla's ShardingType number of ``tensor``'s sharding, None when replicated/none."""
    spec = _get_xla_sharding_spec(tensor)
    if spec in ("", "{replicated}"):
        return None
    return 5 if "last_tile_dim_replicate" in spec else 3
