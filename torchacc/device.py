"""The plugin's torch device: PrivateUse1 renamed to ``torchacc``, and the JAX device behind it.

Device choice (Note [Device choice]): ``TORCHACC_DEVICE`` = ``gpu``/``cuda``/``cpu`` forces a JAX
platform; otherwise the first GPU JAX sees, else CPU. In a multi-process job each process uses its
own local device (index = local rank), see torchacc/distributed.
"""

from __future__ import annotations

import functools
import itertools
import os

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from torchacc import _jaxconfig  # noqa: F401
import jax  # noqa: E402

DEVICE_TYPE = "torchacc"


class _BackendModule:
    """What torch expects of ``torch.torchacc`` (AMP, seeding, availability)."""

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def get_amp_supported_dtype():
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def is_bf16_supported():
        return True

    @staticmethod
    def _is_in_bad_fork():
        return False

    @staticmethod
    def manual_seed_all(seed):
        from torchacc import random

        random.manual_seed(seed)

    manual_seed = manual_seed_all

    @staticmethod
    def synchronize(device=None):
        from torchacc import execute

        execute.wait_device_ops()


class _DeviceGuard(torch._C._acc.DeviceGuard):
    """torch asks the device guard for its device type a few times per op and per autograd node;
    a C-level callable answers without running a Python frame each time."""

    def __init__(self):
        super().__init__()
        self.type_ = itertools.repeat(torch._C._autograd.DeviceType.PrivateUse1).__next__


_registered = False


def register_backend():
    global _registered
    if _registered:
        return
    if torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
        _setup_privateuseone_for_python_backend(
            DEVICE_TYPE, backend_module=_BackendModule(), device_guard=_DeviceGuard()
        )
    _registered = True


@functools.lru_cache(maxsize=None)
def platform():
    """The JAX platform torchacc runs on: 'gpu' or 'cpu'."""
    from torchacc.distributed import runtime  # join a torchrun job before JAX starts its backends

    runtime.maybe_initialize()  # (Note [Multi-process programs] in torchacc/distributed)
    forced = os.environ.get("TORCHACC_DEVICE", "").lower()
    if forced in ("gpu", "cuda"):
        return "gpu"
    if forced == "cpu":
        return "cpu"
    if forced:
        raise ValueError(f"TORCHACC_DEVICE={forced!r}: expected 'gpu', 'cuda' or 'cpu'")
    try:
        return "gpu" if jax.devices("gpu") else "cpu"
    except RuntimeError:
        return "cpu"


@functools.lru_cache(maxsize=None)
def jax_device():
    """The JAX device this process computes on (its local device in a multi-process job)."""
    try:
        devices = jax.local_devices(backend=platform())
    except RuntimeError as e:
        forced = os.environ.get("TORCHACC_DEVICE", "")
        if not forced:
            raise
        raise RuntimeError(
            f"TORCHACC_DEVICE={forced!r} asks for a {platform()} device, but JAX has none ({e}). "
            "Install JAX for that platform (e.g. jax[cuda12]) or unset TORCHACC_DEVICE."
        ) from e
    return devices[0]


def device(index=0):
    """The torch device for torchacc tensors: ``torch.device('torchacc', index)``."""
    register_backend()
    if index not in (0, None):
        raise ValueError(
            f"torchacc.device({index}): each process drives one device; index must be 0 "
            "(use one process per GPU, as torchrun does)"
        )
    return torch.device(DEVICE_TYPE, 0)


def device_hw():
    """'GPU' or 'CPU', like torch_xla's xla_device_hw."""
    return "GPU" if platform() == "gpu" else "CPU"
