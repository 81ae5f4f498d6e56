"""``torch_xla.runtime`` (``xr``) on torchacc: ranks, device type and the compilation cache."""

from __future__ import annotations

import os

import torchacc
from torchacc.sharding import api as _sharding
from torchacc.torch_xla._api import differs
from torchacc.torch_xla.core import xla_model as _xm


def world_size():
    """Number of processes (one device each)."""
    return _xm.world_info()[1]


def global_ordinal():
    return _xm.world_info()[0]


def local_ordinal():
    return _xm.world_info()[2]


def process_index():
    return _xm.world_info()[0]


def process_count():
    return _xm.world_info()[1]


def local_process_count():
    return _xm.world_info()[3]


def local_device_count():
    """Devices of this process (SPMD mode: its local devices; else its one device)."""
    return _sharding.local_device_count() if _sharding.is_spmd() else 1


def addressable_device_count():
    return 1


def global_device_count():
    return global_runtime_device_count()


def global_runtime_device_count():
    """Devices of the job JAX sees (every process's local devices; one per process when each
    process joined with its own device), SPMD mode or not, as torch_xla counts them."""
    return _sharding.device_count()


def device_type():
    """``'CUDA'`` or ``'CPU'`` (torch_xla's PJRT device type names)."""
    return "CUDA" if torchacc.device_hw() == "GPU" else "CPU"


@differs("JAX's persistent compilation cache; readonly is ignored")
def initialize_cache(path, readonly=False):
    """Keep compiled programs under ``path`` (persistent across runs). ``readonly`` is accepted
    for compatibility; the cache is always written."""
    from torchacc import program as _compile

    return _compile.enable_persistent_cache(str(path))


def addressable_runtime_device_count():
    """Devices this process drives (SPMD mode: its local devices)."""
    return _sharding.local_device_count() if _sharding.is_spmd() else 1


def host_index():
    """Index of this node (host) in the job."""
    rank, _, local_rank, local_world = _xm.world_info()
    return (rank - local_rank) // max(local_world, 1)


def runtime_device_attributes(device=None):
    """Attributes of this process's device (JAX's view of it)."""
    dev = torchacc.jax_device()
    return {"name": str(dev), "device_kind": dev.device_kind, "platform": dev.platform}


def global_runtime_device_attributes():
    if not _sharding.is_spmd():
        return [runtime_device_attributes()] * global_runtime_device_count()
    from torchacc.sharding import api as mesh

    return [
        {
            "name": str(d),
            "device_kind": d.device_kind,
            "platform": d.platform,
            "process_index": d.process_index,
        }
        for d in mesh.devices()
    ]


def is_bf16_supported():
    return True


def get_master_ip():
    """The job's master address (torchrun's ``MASTER_ADDR``; ``localhost`` for one process)."""
    import os

    return os.environ.get("MASTER_ADDR") or "localhost"


def get_num_cached_compilation_graph():
    """Number of compiled steps in the in-memory cache."""
    from torchacc import program as _compile

    return _compile.cache_size()


_DEVICE_TYPES = {"CPU": "cpu", "CUDA": "gpu", "GPU": "gpu"}


def set_device_type(pjrt_device):
    """Choose the device type (``'CPU'``, ``'CUDA'``/``'GPU'``) before the device is first used:
    sets ``TORCHACC_DEVICE`` (torch_xla sets ``PJRT_DEVICE``)."""
    import os

    from torchacc.runtime import device as _device

    kind = _DEVICE_TYPES.get(str(pjrt_device).upper())
    if kind is None:
        raise NotImplementedError(
            f"xr.set_device_type({pjrt_device!r}): torchacc runs on 'CPU' or 'CUDA' (GPU) through "
            "JAX; TPU and other PJRT devices are not supported"
        )
    if _device.platform.cache_info().currsize and _device.platform() != kind:
        raise RuntimeError(
            f"xr.set_device_type({pjrt_device!r}): the device is already initialized as "
            f"{device_type()}; call set_device_type before the first device use"
        )
    os.environ["TORCHACC_DEVICE"] = kind


def is_spmd():
    """Whether SPMD mode is on (``use_spmd()`` or ``XLA_USE_SPMD=1``). Like torch_xla, it reads
    ``XLA_USE_SPMD`` (which ``use_spmd()`` sets): a script that deletes it is told SPMD is off,
    and ``use_spmd()`` sets it again."""
    return _sharding.is_spmd() and os.environ.get("XLA_USE_SPMD", "") not in ("", "0")


def use_spmd(auto=False):
    """SPMD mode: the torchacc device becomes one virtual device over every device of the job,
    and ``torch_xla.distributed.spmd`` shards tensors over them (Note [SPMD mode] in
    torchacc/sharding/mesh.py). Call it before the first tensor is moved to the device."""
    if auto:
        raise NotImplementedError(
            "xr.use_spmd(auto=True): XLA's auto-sharding is not exposed through JAX on CPU/GPU; "
            "annotate with xs.mark_sharding"
        )
    _sharding.use_spmd()
