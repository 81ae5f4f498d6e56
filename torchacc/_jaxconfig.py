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
