"""JAX process configuration torchacc needs before any array is made.

PyTorch has real int64/float64 tensors (indices, targets, step counters), so JAX runs with x64 on;
every rule names its dtypes explicitly, so no computation silently widens to 64 bits.

Memory: see README "Sharing a GPU with PyTorch". Unless the user chose otherwise, JAX does not
preallocate most of the GPU, so the eager baseline and the torch CUDA allocator can coexist.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)


def _cpu_device_count():
    """Local CPU devices asked for with torch_xla's ``CPU_NUM_DEVICES`` (read with
    ``PJRT_DEVICE=CPU`` or no ``PJRT_DEVICE``); None when unset. XLA's own
    ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` is honoured by XLA itself."""
    text = os.environ.get("CPU_NUM_DEVICES", "").strip()
    if not text or os.environ.get("PJRT_DEVICE", "CPU").strip().upper() != "CPU":
        return None
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"torchacc: CPU_NUM_DEVICES={text!r} is not a whole number") from None
    if n < 1:
        raise ValueError(f"torchacc: CPU_NUM_DEVICES={n}: need at least one device")
    return n


if _cpu_device_count() is not None:  # Note [SPMD mode] in torchacc/sharding/mesh.py
    jax.config.update("jax_num_cpu_devices", _cpu_device_count())
