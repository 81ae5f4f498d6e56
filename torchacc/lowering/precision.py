"""float32 matmul and convolution precision on XLA: torch's flags decide.

Note [float32 precision follows torch]
XLA:GPU computes float32 dots and convolutions in TF32 on Ampere and newer unless asked for
HIGHEST, and JAX's default (``jax_default_matmul_precision`` unset) lets it. PyTorch's defaults
differ per op: matmuls are full fp32 (``torch.get_float32_matmul_precision() == "highest"``,
i.e. ``torch.backends.cuda.matmul.allow_tf32 = False``) while cuDNN convolutions may use TF32
(``torch.backends.cudnn.allow_tf32 = True``). torchacc keeps torch's meaning, so a script gets
the same precision with or without ``--compiler-opt``:

==================================================  ==========================================
torch setting                                       float32 precision in the compiled step
==================================================  ==========================================
float32_matmul_precision "highest" (default)        dots: ``lax.Precision.HIGHEST`` (fp32)
"high" (``cuda.matmul.allow_tf32 = True``)          dots: ``HIGH`` (TF32 on GPU)
"medium"                                            dots: ``DEFAULT`` (XLA's fastest)
``cudnn.allow_tf32`` False                          convolutions: ``HIGHEST``
``cudnn.allow_tf32`` True (default)                 convolutions: ``DEFAULT`` (TF32 on GPU)
==================================================  ==========================================

Any other matmul-like JAX call inside a rule is traced under ``jax.default_matmul_precision`` of
the matmul setting (:func:`scope`). The flags are read when a step is compiled and are part of
the compiled step's cache key (:func:`key`), so changing them between steps recompiles instead of
reusing a program built for the other precision. On XLA:CPU all of these are exact fp32.
Half-precision inputs are unaffected (they accumulate in float32 either way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

_DOT = {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH}
_JAX_DEFAULT = {"highest": "highest", "high": "tensorfloat32", "medium": "bfloat16"}


def key():
    """The settings a compiled step depends on: (float32 matmul precision, cuDNN TF32)."""
    return torch.get_float32_matmul_precision(), bool(torch.backends.cudnn.allow_tf32)


def dot_precision(dtype):
    """lax precision of a matmul of ``dtype``, following torch.get_float32_matmul_precision()."""
    if dtype != jnp.float32:
        return lax.Precision.DEFAULT
    return _DOT.get(torch.get_float32_matmul_precision(), lax.Precision.DEFAULT)


def conv_precision(dtype):
    """lax precision of a convolution of ``dtype``, following torch.backends.cudnn.allow_tf32."""
    if dtype == jnp.float32 and not torch.backends.cudnn.allow_tf32:
        return lax.Precision.HIGHEST
    return lax.Precision.DEFAULT


def scope():
    """Context for tracing a step: JAX's default matmul precision = torch's matmul setting."""
    return jax.default_matmul_precision(_JAX_DEFAULT[torch.get_float32_matmul_precision()])
