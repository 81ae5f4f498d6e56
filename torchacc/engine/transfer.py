"""Host <-> device transfers of Values: uploads of CPU tensors, reads of computed arrays."""

from __future__ import annotations

import time

import jax
import ml_dtypes
import numpy as np
import torch

from torchacc import metrics
from torchacc.ir import Value, contiguous_desc
from torchacc.runtime import mesh
from torchacc.runtime.device import jax_device


def put(host_array):
    if mesh.is_spmd():  # replicated over the engine mesh (Note [SPMD mode])
        return mesh.put(np.asarray(host_array))
    return jax.device_put(host_array, jax_device())


def _numpy_of(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.uint32:
        return t.view(torch.int32).numpy().view(np.uint32)
    return t.numpy()


def upload(host):
    """A data Value on the device with a copy of the CPU tensor ``host``."""
    host = host.detach().contiguous()
    start = time.perf_counter()
    # copy: on XLA:CPU device_put may alias the numpy buffer, and the host tensor can change later
    array = put(np.array(_numpy_of(host), copy=True))
    metrics.record_time("TransferToDeviceTime", time.perf_counter() - start)
    metrics.counter_inc("TransferToDevice")
    return Value(contiguous_desc(tuple(host.shape), host.dtype), array=array)


def read(array, dtype):
    """A CPU tensor of ``dtype`` with the data of device ``array`` (waits for it)."""
    start = time.perf_counter()
    host = mesh.gather(array) if mesh.is_spmd() else np.array(array)
    metrics.record_time("TransferFromDeviceTime", time.perf_counter() - start)
    metrics.counter_inc("TransferFromDevice")
    if host.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    out = torch.from_numpy(host)
    return out if out.dtype == dtype else out.to(dtype)
