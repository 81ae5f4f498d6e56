"""``torch_xla.runtime`` (``xr``) on torchacc: ranks, device type and the compilation cache."""

from __future__ import annotations

import torchacc
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
    return 1


def addressable_device_count():
    return 1


def global_device_count():
    return world_size()


def global_runtime_device_count():
    return world_size()


def device_type():
    """``'CUDA'`` or ``'CPU'`` (torch_xla's PJRT device type names)."""
    return "CUDA" if torchacc.device_hw() == "GPU" else "CPU"


def initialize_cache(path, readonly=False):
    """Keep compiled programs under ``path`` (persistent across runs). ``readonly`` is accepted
    for compatibility; the cache is always written."""
    from torchacc import program as _compile

    return _compile.enable_persistent_cache(str(path))


def is_spmd():
    return False


def use_spmd(auto=False):
    raise NotImplementedError(
        "torchacc does not implement torch_xla SPMD (use_spmd); use one "
        "process per device with torchrun"
    )
