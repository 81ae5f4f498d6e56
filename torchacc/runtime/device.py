"""The JAX device behind torchacc: which platform, which device of this process.

Note [Device choice]: ``TORCHACC_DEVICE`` = ``gpu``/``cuda``/``cpu`` forces a JAX platform;
otherwise the first GPU JAX sees, else CPU. In a multi-process job each process uses its own local
device (index = local rank), see torchacc/distributed.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax  # noqa: E402

from torchacc import (
    _jaxconfig,  # noqa: F401  (before JAX makes any array)
    launch_checks,  # noqa: E402
)
from torchacc.lowering import target  # noqa: E402
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
        if jax.devices("gpu"):
            return "gpu"
    except RuntimeError:
        pass
    _warn_if_torch_sees_cuda()
    return "cpu"


target.set_platform_resolver(platform)  # rules that pick a kernel per platform (fused attention)


def _warn_if_torch_sees_cuda():
    """One warning (platform() is cached) when torch has CUDA GPUs but JAX none."""
    msg = launch_checks.cuda_jax_mismatch(
        launch_checks.cuda_device_count(), launch_checks.jax_cuda_plugins(), jax_sees_gpu=False
    )
    if msg:
        warnings.warn(f"torchacc: {msg}", RuntimeWarning, stacklevel=3)


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


def device_hw():
    """'GPU' or 'CPU', like torch_xla's xla_device_hw."""
    return "GPU" if platform() == "gpu" else "CPU"
