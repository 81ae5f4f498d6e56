"""Host-side PRNG key data: what ``jax.random.key(seed)`` holds, without running JAX ops."""

from __future__ import annotations

import numpy as np

from torchacc.runtime.device import platform


def key_data(seed):
    """Key data of ``jax.random.key(seed)`` (threefry2x32: the seed's high and low 32 bits),
    computed on the host: ``torch.manual_seed`` runs every step in seeded training loops, and
    building the key with JAX ops cost ~0.6 ms. tests/test_core_device.py checks it against JAX."""
    platform()  # first JAX use may be here (torch.manual_seed): join a torchrun job before it
    seed &= 0xFFFFFFFFFFFFFFFF  # torch seeds are unsigned 64-bit; negative ones wrap as in JAX
    return np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)
