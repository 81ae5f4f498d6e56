"""The JAX device behind torchacc: which platform, which device of this process.

Note [Device choice]: ``TORCHACC_DEVICE`` = ``gpu``/``cuda``/``cpu`` forces a JAX platform;
otherwise the first GPU JAX sees, else CPU. In a multi-process job each process uses its own local
device (index = local rank), see torchacc/distributed.
"""

from __future__ import annotations

import functools
import os

import jax  # noqa: E402

from torchacc import _jaxconfig  # noqa: F401  (before JAX makes any array)
from torchacc.runtime import processes  # noqa: E402


@functools.lru_cache(maxsize=None)
def platform():
    """The JAX platform torchacc runs on: 'gpu' or 'cpu'."""
    # join a torchrun job before JAX starts its backends (Note [Multi-process programs])
    processes.maybe_initialize()
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
    devices = jax.local_devices(backend=platform())
    return devices[0]


def device_hw():
    """'GPU' or 'CPU', like torch_xla's xla_device_hw."""
    return "GPU" if platform() == "gpu" else "CPU"
