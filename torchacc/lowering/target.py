"""The platform the step being lowered will run on, for rules that pick a kernel per platform.

Rules never see devices (Note [Rule calling convention]); a few (fused attention) still need to know
whether they are lowered for XLA:GPU. The runtime stage, which owns the device choice (Note [Device
choice]), registers its resolver here; without one, JAX's default backend answers.
"""

from __future__ import annotations

import jax

_resolver = [None]


def set_platform_resolver(fn):
    """``fn() -> 'gpu' | 'cpu'``: the platform torchacc compiles for (runtime.device.platform)."""
    _resolver[0] = fn


def platform():
    """'gpu' or 'cpu' (or another JAX platform name)."""
    if _resolver[0] is not None:
        return _resolver[0]()
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend
