"""Host <-> device transfers of Values: uploads of CPU tensors, reads of computed arrays."""

from __future__ import annotations

import time
import warnings

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
    metrics.record_time("TransferToDeviceTime", time.perf_counter() - start)
    metrics.counter_inc("TransferToDevice")
    sent = sent_bytes(array)
    metrics.counter_inc("TransferToDeviceBytes", sent)
    metrics.record_value("OutboundData", sent)
    value = Value(contiguous_desc(tuple(host.shape), host.dtype), array=array)
    value.host = mirror
    return value


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
