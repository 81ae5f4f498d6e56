"""Host <-> device transfers of Values: uploads of CPU tensors, reads of computed arrays."""

from __future__ import annotations

import time
import warnings
import weakref

import jax
import ml_dtypes
import numpy as np
import torch

from torchacc import metrics
from torchacc.ir import Value, contiguous_desc
from torchacc.lowering.dtypes import TORCH_TO_JAX, stored_dtype
from torchacc.runtime.device import jax_device
from torchacc.sharding import mesh


def put(host_array):
    if mesh.is_spmd():  # replicated over the engine mesh (Note [SPMD mode])
        return mesh.put(np.asarray(host_array))
    return jax.device_put(host_array, jax_device())


# dtypes numpy lacks: moved as raw bits of the same width, viewed as ml_dtypes' type
_BITS = {
    torch.bfloat16: (torch.int16, np.int16, ml_dtypes.bfloat16),
    torch.float8_e5m2: (torch.uint8, np.uint8, ml_dtypes.float8_e5m2),
    torch.float8_e4m3fn: (torch.uint8, np.uint8, ml_dtypes.float8_e4m3fn),
}
_FROM_ML = {np.dtype(ml): (np_bits, t) for t, (_tb, np_bits, ml) in _BITS.items()}


def _numpy_of(t):
    bits = _BITS.get(t.dtype)
    if bits is not None:
        return t.view(bits[0]).numpy().view(bits[2])
    if t.dtype == torch.uint32:
        return t.view(torch.int32).numpy().view(np.uint32)
    return t.numpy()


# integer/bool uploads this small keep a CPU copy on their Value (Note [Reads of host-known
# values] in torchacc/lazy/host_eval.py): an attention mask of 8 x 8192 tokens is 65,536 elements
MIRROR_MAX_ELEMENTS = 1 << 16


def upload(host):
    """A data Value on the device with a copy of the CPU tensor ``host``."""
    host = host.detach().contiguous()
    start = time.perf_counter()
    array, mirror = device_array(host)
    _count_upload(array, start)
    value = Value(contiguous_desc(tuple(host.shape), host.dtype), array=array)
    value.host = mirror
    return value


def _count_upload(array, start):
    metrics.record_time("TransferToDeviceTime", time.perf_counter() - start)
    metrics.counter_inc("TransferToDevice")
    sent = sent_bytes(array)
    metrics.counter_inc("TransferToDeviceBytes", sent)
    metrics.record_value("OutboundData", sent)


# Note [Deferred uploads]
# In SPMD mode torch_xla's tensors live on one virtual device, and data moved there
# (``t.to(device)``, ``torch.tensor(..., device=...)``, a CPU fallback's result) stays on the host
# until its layout is known: ``mark_sharding`` then sends each device its shard only (one
# transfer, instead of a replicated upload and a reshard). Any other use uploads it replicated:
# an op recording it (lazy/record.py, while ``DEFERRED[0]`` counts any), the next sync (its walk
# over live storages reads every ``buf``, as torch_xla's sync uploads tensors that only have host
# data), or anything else reading its ``buf``. A read (``.cpu()``) answers from the host copy
# without a transfer. A device loader (``MpDeviceLoader``/``ParallelLoader``) uploads every
# tensor still waiting when it is created (``upload_waiting``): the training loop it feeds starts
# there, so its steps' transfers are its batches. ``Deferred`` is that Value: its ``buf`` slot
# holds the CPU tensor and its ``buf`` property uploads it on first access, after which the
# object becomes a plain ``Value`` (the same slots), so the engine's hot paths never pay for it.

_BUF = Value.__dict__["buf"]  # the slot under the property
DEFERRED = [0]  # Deferred Values still on the host
# the arrays of replicated uploads, while they live: torch_xla gives data moved to the device and
# never marked no sharding spec at all ('' rather than '{replicated}', torch_xla/_XLAC.py)
uploaded = weakref.WeakValueDictionary()


class Deferred(Value):
    """A data Value whose CPU copy is not on the device yet (Note [Deferred uploads])."""

    __slots__ = ()

    def __init__(self, host, mirror=None):
        self.node = None
        self.index = 0
        self.desc = contiguous_desc(tuple(host.shape), host.dtype)
        self.mark = 0
        self.sid = 0
        self.host = mirror
        _BUF.__set__(self, host)
        DEFERRED[0] += 1

    @property
    def buf(self):
        return self.upload()

    @buf.setter
    def buf(self, array):  # replaced (say resharded): no longer on the host
        _BUF.__set__(self, array)
        self._settle()

    def host_data(self):
        """The CPU tensor (contiguous, the Value's dtype)."""
        return _BUF.__get__(self)

    def upload(self, sharding=None, padded=None):
        """Send the data to the device, laid out by ``sharding`` (default replicated; ``padded``:
        the global shape with padding, Note [Padded shards] in sharding/layout.py); the Value
        becomes a plain one. Returns the array."""
        host = _BUF.__get__(self)
        if padded is not None and tuple(padded) != tuple(host.shape):
            full = host.new_zeros(padded)
            full[tuple(slice(0, n) for n in host.shape)] = host
            host = full
        start = time.perf_counter()
        array, _ = device_array(host, sharding)
        _count_upload(array, start)
        if sharding is None:
            uploaded[id(array)] = array
        _BUF.__set__(self, array)
        self._settle()
        return array

    def _settle(self):
        self.__class__ = Value
        DEFERRED[0] -= 1

    def __del__(self):  # dropped while still on the host
        try:
            DEFERRED[0] -= 1
        except TypeError:  # interpreter shutdown
            pass


def defer(host):
    """A Deferred Value holding a copy of the contiguous CPU tensor ``host`` (SPMD mode; Note
    [Deferred uploads])."""
    host = host.clone()  # the caller's tensor may change later
    dtype = host.dtype
    exact = not (dtype.is_floating_point or dtype.is_complex)
    stored = stored_dtype(dtype) if dtype in TORCH_TO_JAX else dtype
    small = exact and stored is dtype and host.numel() <= MIRROR_MAX_ELEMENTS
    return Deferred(host, host if small else None)  # the same copy as upload() keeps


def upload_waiting():
    """Upload, replicated, every live tensor's data still on the host (Note [Deferred
    uploads])."""
    if not DEFERRED[0]:
        return
    from torchacc.ir import live_storages

    materialize([st.value for st in live_storages()])


def materialize(values):
    """Upload, replicated, the Deferred Values among ``values`` (an op recording them)."""
    for v in values:
        if type(v) is Deferred:
            v.upload()


def is_deferred(value):
    return type(value) is Deferred


def stored(value):
    """``value``'s buffer without uploading anything: None while it is pending or still on the
    host (Note [Deferred uploads])."""
    if value.node is not None or type(value) is Deferred:
        return None
    return value.buf


def sent_bytes(array):
    """Bytes an upload of ``array`` sent to this process's devices (each addressable shard)."""
    sharding = getattr(array, "sharding", None)
    if sharding is None or len(sharding.device_set) == 1:
        return int(array.nbytes)
    return mesh.upload_bytes(array.shape, array.dtype.itemsize, sharding)


def device_array(host, sharding=None, local=False):
    """A JAX array with a copy of the contiguous CPU tensor ``host`` in its stored dtype (Note
    [Device dtypes]), and the CPU copy a small integer/bool one keeps for reads (Note [Reads of
    host-known values] in torchacc/lazy/host_eval.py; None otherwise); any thread. SPMD mode:
    laid out by ``sharding`` (default replicated); ``local``: ``host`` is this process's share of
    a global batch (Note [Per-process batches] in sharding/data.py), which keeps no CPU copy."""
    dtype = host.dtype
    stored = stored_dtype(dtype) if dtype in TORCH_TO_JAX else dtype
    data = host if stored is dtype else host.to(stored)
    # copy: on XLA:CPU device_put may alias the numpy buffer, and the host tensor can change later
    data = np.array(_numpy_of(data), copy=True)
    if local:
        return mesh.put_local(data, sharding), None
    array = mesh.put(data, sharding) if sharding is not None else put(data)
    mirror = None
    exact = not (dtype.is_floating_point or dtype.is_complex)  # only those are read on the host
    if exact and stored is dtype and host.numel() <= MIRROR_MAX_ELEMENTS:
        mirror = host.clone()
    return array, mirror


def read(array, dtype):
    """A CPU tensor of ``dtype`` with the data of device ``array`` (waits for it)."""
    start = time.perf_counter()
    if mesh.is_spmd():
        if not getattr(array, "is_fully_replicated", True):  # torch_xla's name for the gather
            metrics.counter_inc("ReplicateShardedData")
        host = mesh.gather(array)
    else:
        host = np.array(array)
    return _host_tensor(host, dtype, start)


def read_view(array, dtype):
    """A CPU tensor of ``dtype`` with the data of the single-device ``array`` (waits for it),
    without a copy where the device's memory is host memory (a CPU device): a read-only view, for
    a caller that only reads it while ``array`` lives and nobody donates it (an asynchronous
    save's private copy). Elsewhere the device-to-host copy :func:`read` makes."""
    start = time.perf_counter()
    host = np.asarray(array)  # zero-copy on a CPU device
    with warnings.catch_warnings():  # read-only memory: the caller only reads it
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return _host_tensor(host, dtype, start)


def _host_tensor(host, dtype, start):
    """The torch tensor of the numpy array ``host`` read from the device (counted as one
    transfer since ``start``): ml_dtypes' types reinterpreted as torch's, then cast to ``dtype``."""
    metrics.record_time("TransferFromDeviceTime", time.perf_counter() - start)
    metrics.counter_inc("TransferFromDevice")
    bits = _FROM_ML.get(host.dtype)
    if bits is not None:
        out = torch.from_numpy(host.view(bits[0])).view(bits[1])
    else:
        out = torch.from_numpy(host)
    return out if out.dtype == dtype else out.to(dtype)


def device_array_on(host, device):
    """The contiguous CPU tensor ``host`` on one JAX ``device`` in its stored dtype (a shard)."""
    dtype = host.dtype
    stored = stored_dtype(dtype) if dtype in TORCH_TO_JAX else dtype
    data = host if stored is dtype else host.to(stored)
    return jax.device_put(np.array(_numpy_of(data), copy=True), device)
