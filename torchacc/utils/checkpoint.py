"""``torchacc.utils.checkpoint.gradient_checkpoint(model, gc_cls)``: TorchAcc's call for gradient
checkpointing by layer class name, over ``Config.memory.gc``'s own (``apply_gc``,
torchacc/accel/gc.py, with the lazy frontend's ``checkpoint``: Note [Checkpointing that saves
memory])."""

from __future__ import annotations

import torch

from torchacc.accel.gc import apply_gc
from torchacc.lazy.checkpoint import checkpoint

__all__ = ["checkpoint", "gradient_checkpoint"]


def gradient_checkpoint(model: torch.nn.Module, gc_cls):
    """Checkpoint every submodule of ``model`` whose class name is in ``gc_cls`` (a set of names,
    as ``Config.memory.gc_cls``), in place, and return ``model``. The model may be on the CPU
    still (TorchAcc's scripts call this before ``model.to(device)``). A name that is no class of
    the model is a ``ValueError``, and then nothing is checkpointed."""
    if isinstance(gc_cls, str):
        gc_cls = {gc_cls}
    names = set(gc_cls)
    present = {type(m).__name__ for m in model.modules()}
    missing = sorted(names - present)
    if missing:
        raise ValueError(
            f"gradient_checkpoint: gc_cls names {missing}, no class of the "
            f"{type(model).__name__} model (its classes: {sorted(present)})"
        )
    apply_gc(model, names)
    return model
