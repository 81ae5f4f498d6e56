"""``xla_model``: ranks and ordinals, devices and replication (torch_xla's first section).

Note: xla_model.py re-exports every public name; see its docstring."""

from __future__ import annotations

import importlib
import os
import sys

import torch

import torchacc
from torchacc import metrics  # noqa: F401
from torchacc.lazy.device import DEVICE_TYPE
from torchacc.torch_xla._api import differs

REDUCE_SUM = "sum"
REDUCE_MUL = "mul"
REDUCE_AND = "and"
REDUCE_OR = "or"
REDUCE_MIN = "min"
REDUCE_MAX = "max"
_REDUCE_TYPES = (REDUCE_SUM, REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, REDUCE_MAX)


# --------------------------------------------------------------------------------------------
# ranks


_modules: dict = {}


def _distributed_module(name="torchacc.distributed"):
    """The module ``name``, or None when it does not exist (looked up once)."""
    if name in _modules:
        return _modules[name]
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not name.startswith(exc.name):
            raise
        mod = None
    _modules[name] = mod
    return mod


def _ask_distributed(*names):
    mod = _distributed_module()
    if mod is None:
        return None
    for name in names:
        fn = getattr(mod, name, None)
        if callable(fn):
            value = fn()
            if value is not None:
                return int(value)
    return None


def _env_int(*names, default):
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def world_info():
    """``(rank, world_size, local_rank, local_world_size)`` of this process.

    From ``torchacc.distributed`` (``get_rank``/``get_world_size``/``get_local_rank``/
    ``get_local_world_size``, or ``rank``/``world_size``/...) when present, else the environment a
    launcher sets (torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``), else 1
    process. ``torch.distributed.get_rank`` is deliberately not consulted: TorchAcc recipes rebind
    it to :func:`get_ordinal`.
    """
    world = _ask_distributed("get_world_size", "world_size")
    if world is None:
        world = _env_int("WORLD_SIZE", default=1)
    rank = _ask_distributed("get_rank", "rank", "global_rank")
    if rank is None:
        rank = _env_int("RANK", default=0)
    local_rank = _ask_distributed("get_local_rank", "local_rank")
    if local_rank is None:
        local_rank = _env_int("LOCAL_RANK", default=rank if world == 1 else 0)
    local_world = _ask_distributed("get_local_world_size", "local_world_size")
    if local_world is None:
        local_world = _env_int("LOCAL_WORLD_SIZE", default=world)
    return rank, world, local_rank, local_world


def get_ordinal(defval=0):
    """Global rank of this process."""
    return world_info()[0]


def get_local_ordinal(defval=0):
    """Rank of this process on its node."""
    return world_info()[2]


def xrt_world_size(defval=1):
    """Number of processes (one device each) in the job."""
    return world_info()[1]


world_size = xrt_world_size


def is_master_ordinal(local=True):
    """Whether this is rank 0 (of the node when ``local``, of the job otherwise)."""
    return (get_local_ordinal() if local else get_ordinal()) == 0


def master_print(*args, fd=sys.stdout, local=False, flush=False):
    if is_master_ordinal(local=local):
        print(*args, file=fd, flush=flush)


# --------------------------------------------------------------------------------------------
# devices


@differs("n must be None/0: one device per process")
def xla_device(n=None, devkind=None):
    """The torchacc device of this process (``n`` may only be ``None``/0: one device each)."""
    if devkind not in (None, "GPU", "CUDA", "CPU", "TPU"):
        raise ValueError(f"xla_device: unknown devkind {devkind!r}")
    return torchacc.device(0 if n is None else n)


def get_xla_supported_devices(devkind=None, max_devices=None):
    return [str(torchacc.device())]


def xla_device_hw(device):
    """``'GPU'`` or ``'CPU'``: the hardware behind a torchacc device."""
    kind = device if isinstance(device, str) else torch.device(device).type
    if kind.split(":")[0] not in ("torchacc", "xla"):
        raise RuntimeError(f"xla_device_hw: {device} is not a torchacc device")
    return torchacc.device_hw()


def xla_real_devices(devices=None):
    hw = "CUDA" if torchacc.device_hw() == "GPU" else "CPU"
    return [f"{hw}:{get_local_ordinal()}" for _ in (devices or [None])]


def is_xla_tensor(tensor):
    return isinstance(tensor, torch.Tensor) and tensor.device.type == DEVICE_TYPE


_replication = []


@differs("one device per process: devices may only be [device]")
def set_replication(device, devices):
    """Declare the devices this process replicates over (the seed calls it with ``[device]``).

    One device per process: ``devices`` may hold only this process's device. In a multi-process
    job ``torchacc.distributed.set_replication`` is called when it exists.
    """
    device = torch.device(device)
    if device.type not in (DEVICE_TYPE, "xla"):
        raise ValueError(f"set_replication: {device} is not a torchacc device")
    devices = [torch.device(d) for d in devices or []]
    if len(devices) > 1:
        raise ValueError(
            "set_replication: torchacc drives one device per process; run one process per device "
            "(torchrun --nproc_per_node) instead of replicating over several devices in one process"
        )
    _replication[:] = devices
    mod = _distributed_module()
    fn = getattr(mod, "set_replication", None) if mod is not None else None
    if fn is not None and xrt_world_size() > 1:
        fn(device, devices)


def get_replication_devices():
    return list(_replication)
