"""Host <-> device for LazyTensors: uploads, reads (counted transfers) and deepcopy."""

from __future__ import annotations

import torch

from torchacc.engine import execute, handoff, transfer
from torchacc.engine.transfer import upload as _upload
from torchacc.ir import Value, contiguous_desc
from torchacc.lazy.device import DEVICE_TYPE
from torchacc.lazy.host_eval import host_value
from torchacc.lazy.record import fresh, value_of
from torchacc.lazy.tensor import LazyTensor
from torchacc.sharding import mesh


def upload(host, defer=False):
    """A data Value on the device with a copy of the contiguous CPU tensor ``host``, remembered
    as an upload (``is_upload``). ``defer`` (a ``.to(device)``): in SPMD mode the copy stays on
    the host until its layout is known (Note [Deferred uploads] in engine/transfer.py)."""
    if defer and mesh.is_spmd():
        return transfer.defer(host)
    value = _upload(host)
    _uploads[id(value.buf)] = value.buf
    return value


def to_device(host):
    if type(host) is LazyTensor:
        return host
    return fresh(upload(host.detach().contiguous(), defer=True))


# the arrays of uploads, while they live: torch_xla gives data moved to the device and never
# marked no sharding spec at all ('' rather than '{replicated}', torch_xla/_XLAC.py)
_uploads = transfer.uploaded


def is_upload(t):
    """Whether LazyTensor ``t`` holds the data a ``.to(device)`` uploaded (or will: Note
    [Deferred uploads]), unchanged."""
    value = value_of(t)
    if type(value) is transfer.Deferred:
        return True
    return value.node is None and _uploads.get(id(value.buf)) is value.buf


def to_cpu(t):
    """CPU copy of a LazyTensor (runs what it needs; counted as a transfer)."""
    if type(t) is not LazyTensor:
        return t
    value = value_of(t)
    if value.node is not None:
        host = host_value(value)  # Note [Reads of host-known values]
        if host is not None:
            return host
    if value.node is not None and t._view is not None and t._st.value.node is None:
        host = _view_of_computed_storage(t)
        if host is not None:
            return host
    return execute.fetch(value, t.dtype)


def _view_of_computed_storage(t):
    """A view whose storage a sync has computed (say a gradient that is a view of a backward
    result, read after ``mark_step``) still reads the view Value it recorded before the sync. Its
    data is a view of data on hand: read the storage and take the view with torch on the host, so
    the read runs no program (a compile, and a run that spoils the next known step). None where
    the storage is not a plain contiguous array."""
    st = t._st
    shape, _stride, dtype, _offset = st.desc
    if st.desc != contiguous_desc(shape, dtype):
        return None
    host = execute.fetch(st.value, dtype)
    for func, rest, kwargs, index, _ in t._view:
        out = func(host, *rest, **kwargs)
        host = out[index] if isinstance(out, (tuple, list)) else out
    return host.clone()


def deepcopy(t, memo):
    new = _device_copy(t)
    if new is None:
        new = to_device(to_cpu(t))
    if t.requires_grad:
        new.requires_grad_(True)
    if getattr(t, "_is_param", False):
        new = torch.nn.Parameter(new, t.requires_grad)
    memo[id(t)] = new
    return new


def _device_copy(t):
    """A copy of computed data laid out over several devices (SPMD mode), made on the devices
    with the same layout (a host round trip would lose it); None for anything else."""
    import jax

    value = value_of(t)
    array = value.buf if value.node is None and t._view is None else None
    if not isinstance(array, jax.Array) or len(array.sharding.device_set) < 2:
        return None
    copy = jax.device_put(array, array.sharding, may_alias=False)
    new = fresh(Value(contiguous_desc(tuple(t.shape), t.dtype), array=copy))
    mark = getattr(t, "_torchacc_sharding", False)
    if mark is not False:
        new._torchacc_sharding = mark
    return new


# --- the trace-once frontend's program boundary (Note [Device tensors in a trace-once program]) --


def _array_of(t):
    value = value_of(t)
    if value.node is not None:
        execute.run([value], donate=False)
    return value.array


def _tensor_of(array, dtype):
    return fresh(Value(contiguous_desc(tuple(array.shape), dtype), array=array))


def _rebind(t, array):
    st = t._st
    if t._view is not None or st.desc is not t._desc and st.desc != t._desc:
        with torch.no_grad():  # not a whole base tensor: an ordinary (recorded) write
            t.copy_(_tensor_of(array, t.dtype))
        return
    st.value = Value(st.desc, array=array)  # (a Value's array has its logical shape)
    st.version += 1


handoff.register(DEVICE_TYPE, _array_of, _tensor_of, _rebind, LazyTensor)
