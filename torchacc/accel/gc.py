"""``Config.memory.gc`` translated: ``apply_gc`` checkpoints the configured submodules with the
lazy device's ``checkpoint`` (Note [Checkpointing that saves memory] in
torchacc/lazy/checkpoint.py) or, on other devices, ``torch.utils.checkpoint``."""

from __future__ import annotations

import functools
import types

import torch.utils.checkpoint as _torch_checkpoint

from torchacc.lazy.checkpoint import checkpoint

__all__ = ["apply_gc"]


def _checkpointed_forward(run):
    def forward(self, *args, **kwargs):
        return run(type(self).forward.__get__(self), *args, **kwargs)

    return forward


def _hf_checkpointing_layer(module) -> bool:
    """A transformers ``GradientCheckpointingLayer`` (decoder layers of LLaMA, Qwen2, GPT-2, ...):
    its class-level wrapper checkpoints through ``_gradient_checkpointing_func`` once
    ``gradient_checkpointing`` is set, and drops the KV cache for the replay."""
    return hasattr(type(module), "_can_checkpoint_with_cache") and hasattr(
        module, "gradient_checkpointing"
    )


def apply_gc(model, gc_cls, gc_cnt=None, lazy=True):
    """Checkpoint every submodule of ``model`` whose class name is in ``gc_cls`` (the first
    ``gc_cnt`` of them in module order; one nested in a checkpointed one is not checkpointed
    again). Returns the checkpointed modules. ``lazy``: the torchacc device's barrier scheme,
    else ``torch.utils.checkpoint``.

    A transformers layer is checkpointed through its own wrapper (``gradient_checkpointing`` and
    ``_gradient_checkpointing_func``, what ``gradient_checkpointing_enable`` sets): it runs the
    layer with ``use_cache=False`` and no cache, as it must -- a replay that appended to the
    forward's ``DynamicCache`` a second time would attend over every key twice (HF configs default
    to ``use_cache=True``, also in training)."""
    names = set(gc_cls)
    done = []
    inside = set()
    if lazy:
        run = checkpoint
    else:
        run = functools.partial(_torch_checkpoint.checkpoint, use_reentrant=False)
    for module in model.modules():
        if id(module) in inside or type(module).__name__ not in names:
            continue
        if gc_cnt is not None and len(done) >= gc_cnt:
            break
        if _hf_checkpointing_layer(module):
            module._gradient_checkpointing_func = run
            module.gradient_checkpointing = True
        else:
            module.forward = types.MethodType(_checkpointed_forward(run), module)
        done.append(module)
        inside.update(id(m) for m in module.modules())
    return done
