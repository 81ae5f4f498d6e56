"""torch <-> JAX array hand-off for the trace-once frontend: tensors stay where the user keeps them.

Note [Zero-copy hand-off]
CPU: a torch tensor enters a program as a JAX array that *aliases* its memory (DLPack, no copy).
Such a view is cached per tensor (keyed by the tensor's identity and data pointer): a parameter
passed on every call is imported once, and because the view aliases the tensor's memory it sees
every in-place update the user (or torch's optimizer) makes. The view keeps the memory alive, so a
stale cache entry can never point at freed memory; the entry is dropped when the tensor dies.
Only aligned, contiguous tensors are aliased (XLA:CPU copies unaligned buffers; a copy would go
stale), others are copied per call. Programs never donate their inputs, so XLA never writes into
user memory, and every call waits for its outputs before returning (the outputs are handed to
torch), so no program still reads an input when the user mutates it afterwards.
Outputs come back as torch tensors aliasing the fresh XLA output buffers (DLPack, no copy). XLA
returns a distinct fresh buffer for every output of a call (jit never forwards an undonated input),
so in-place writes to one output cannot reach another output, an input or a later call.

CUDA: tensors go through the DLPack protocol objects (``__dlpack__(stream=...)``), which makes the
consumer's stream wait for the producer's: JAX's compute stream waits for torch's current stream
on the way in, and torch's current stream waits for JAX's on the way out. Nothing is cached on
CUDA (a cached view would skip that stream ordering).
"""

from __future__ import annotations

import functools
import weakref

import jax
import numpy as np
import torch
from jax._src.lib import _jax
from torch.utils import dlpack as _torch_dlpack

from torchacc.lowering.dtypes import jdtype
from torchacc.runtime import processes
from torchacc.sharding import mesh

_DL_CPU = 1
_to_dlpack = _torch_dlpack.to_dlpack
_from_dlpack = _torch_dlpack.from_dlpack
_import = _jax.dlpack_managed_tensor_to_buffer
_export = _jax.buffer_to_dlpack_managed_tensor

# id(tensor) -> (weakref to the tensor, data_ptr, aliasing jax array). Note [Zero-copy hand-off]
_views: dict = {}


@functools.lru_cache(maxsize=None)
def cpu_device():
    processes.maybe_initialize()  # join a torchrun job before JAX starts its backends
    return jax.local_devices(backend="cpu")[0]


@functools.lru_cache(maxsize=None)
def gpu_device(index):
    processes.maybe_initialize()
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError:
        devices = []
    if processes.is_initialized() and processes.world_size() > 1 and len(devices) == 1:
        return devices[0]  # one device per process: torch's cuda:LOCAL_RANK is JAX's only one
    if index >= len(devices):
        raise RuntimeError(
            f"torchacc.dynamo: a cuda:{index} tensor reached a compiled graph but JAX sees "
            f"{len(devices)} GPU(s); install a CUDA build of jax (README: GPU set-up) or keep the "
            "model on the CPU"
        )
    return devices[index]


def jax_device_for(device):
    """The JAX device that computes on tensors living on torch ``device``."""
    if device.type == "cpu":
        return cpu_device()
    if device.type == "cuda":
        return gpu_device(device.index or 0)
    raise RuntimeError(
        f"torchacc.dynamo: tensors on {device} are not supported by the torchacc backend "
        "(expected cpu or cuda tensors)"
    )


def _forget(key, _ref):
    _views.pop(key, None)


def to_jax_cpu(t):
    """A JAX CPU array with ``t``'s contents, aliasing ``t`` when possible (cached)."""
    key = id(t)
    hit = _views.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t.data_ptr():
        return hit[2]
    d = t.detach()
    if d.is_conj() or d.is_neg():
        d = d.resolve_conj().resolve_neg()
    if not d.is_contiguous():
        d = d.contiguous()
    arr = _import(_to_dlpack(d), cpu_device(), None, None, _DL_CPU)
    if d.data_ptr() == t.data_ptr() and arr.unsafe_buffer_pointer() == t.data_ptr():
        _views[key] = (weakref.ref(t, functools.partial(_forget, key)), t.data_ptr(), arr)
    return arr


def remember(t, arr):
    """Record ``arr`` as the zero-copy view of CPU tensor ``t``, whose memory ``arr``'s buffer now
    is (Note [Adopting output buffers] in flat.py)."""
    key = id(t)
    _views[key] = (weakref.ref(t, functools.partial(_forget, key)), t.data_ptr(), arr)


def to_jax_cuda(t, device):
    d = t.detach()
    if not d.is_contiguous():
        d = d.contiguous()
    return jax.dlpack.from_dlpack(d, device=device)


def to_jax(t, device):
    """``t`` (a torch tensor) as a JAX array on JAX ``device`` (or sharding)."""
    if isinstance(device, jax.sharding.Sharding) and t.device.type == "cpu":
        return jax.device_put(t.detach().contiguous().numpy(), device)  # SPMD: replicated
    if t.device.type == "cpu":
        if device.platform == "cpu":
            return to_jax_cpu(t)
        return jax.device_put(np.asarray(t.detach().cpu().numpy()), device)
    if t.device.type == "cuda" and device.platform != "cpu":
        return to_jax_cuda(t, device)
    raise RuntimeError(
        f"torchacc.dynamo: an input on {t.device} reached a program compiled for {device}; "
        "keep a graph's tensors on one device"
    )


def to_torch_cpu(arr):
    """A torch CPU tensor aliasing JAX array ``arr``'s buffer (which must be ready)."""
    return _from_dlpack(_export(arr))


def to_torch_cuda(arr):
    return torch.from_dlpack(arr)


def scalar_to_jax(value, dtype, device):
    """A Python number as a 0-d array of torch ``dtype`` on ``device``."""
    return jax.device_put(np.asarray(value, dtype=jdtype(dtype)), device)


def clear_cache():
    """Drop every cached zero-copy view (tests; or to release memory kept alive by views)."""
    _views.clear()


def replicated():
    """Where a program over torchacc-device tensors (SPMD) keeps its scalars and RNG key:
    replicated over the engine mesh, the devices of every array of the program."""
    return mesh.replicated()


def same(x):
    return x
