"""The old import path of gradient checkpointing: ``checkpoint`` and ``optimization_barrier_`` are
the lazy frontend's (torchacc/lazy/checkpoint.py), ``apply_gc`` is ``Config.memory.gc``'s
translation (torchacc/accel/gc.py)."""

from torchacc.accel.gc import apply_gc
from torchacc.lazy.checkpoint import checkpoint, optimization_barrier_

__all__ = ["apply_gc", "checkpoint", "optimization_barrier_"]
