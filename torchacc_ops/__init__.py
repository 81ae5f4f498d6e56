"""torchacc_ops: fused kernels with one API for eager PyTorch and torchacc's compiler path.

================  =========================================  =================================
kernel            torchacc device (``--compiler-opt``)       plain CPU/CUDA tensors (eager)
================  =========================================  =================================
flash_attention   one op each way; cuDNN flash attention     ``F.scaled_dot_product_attention``
                  on XLA:GPU, else the XLA fallback          (flash / efficient / math)
rms_norm          one op each way                            ``F.rms_norm``
apply_rotary_emb  one op each way                            plain torch (float32 math)
swiglu            one op each way                            ``F.silu(gate) * up``
cross_entropy     one op each way, no float32 logits         ``F.cross_entropy``
================  =========================================  =================================

The path is picked by the tensors' device, per call; importing this package does not import
torchacc (so eager runs never load JAX). See Note [Fused kernels] in torchacc/lazy/fused_kernels.py
and Note [Fused attention: cuDNN or the XLA fallback] in torchacc/lowering/fused_attention.py.
"""

from torchacc_ops.functional import (
    apply_rotary_emb,
    cross_entropy,
    flash_attention,
    rms_norm,
    rotary_cos_sin,
    swiglu,
)
from torchacc_ops.modules import RMSNorm

__all__ = [
    "flash_attention",
    "rms_norm",
    "apply_rotary_emb",
    "rotary_cos_sin",
    "swiglu",
    "cross_entropy",
    "RMSNorm",
]
