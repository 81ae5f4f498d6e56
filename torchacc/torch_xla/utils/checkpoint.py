"""``torch_xla.utils.checkpoint`` on torchacc: activation checkpointing that replays the device
RNG in the recompute (dropout masks match the forward's) without a host transfer.

torch's own ``torch.utils.checkpoint`` would ask ``torch.torchacc`` for an RNG state tensor when
``preserve_rng_state``; this wrapper keeps the device RNG itself and calls torch's with
``preserve_rng_state=False``."""

from __future__ import annotations

import torch
import torch.utils.checkpoint as _torch_checkpoint

from torchacc.lazy import checkpoint as _fenced
from torchacc.lazy import random as _device_random
from torchacc.torch_xla.core import xla_model as xm


def get_device_states(*args):
    """The device RNG state (torch_xla's form: devices and their integer states)."""
    return [xm.xla_device()], [xm.get_rng_state()]


def set_device_states(devices, states):
    for state in states:
        xm.set_rng_state(state)


class CheckpointStatus:
    """torch_xla's flag for "inside a checkpointed recompute"."""

    def __init__(self):
        self.is_running_bwd = False

    def is_running_bwd_pass(self):
        return self.is_running_bwd


chkpt_status = CheckpointStatus()


def _replaying(function, preserve_rng_state):
    """``function`` that runs with the device RNG state of its first call on every later call
    (the recompute), then puts the RNG state back where the step had it."""
    saved = []

    def run(*args, **kwargs):
        if not preserve_rng_state:
            return function(*args, **kwargs)
        if not saved:
            saved.append((_device_random.get_state(), torch.get_rng_state()))
            return function(*args, **kwargs)
        current = (_device_random.get_state(), torch.get_rng_state())
        _device_random.set_state(saved[0][0])
        torch.set_rng_state(saved[0][1])
        chkpt_status.is_running_bwd = True
        try:
            return function(*args, **kwargs)
        finally:
            chkpt_status.is_running_bwd = False
            _device_random.set_state(current[0])
            torch.set_rng_state(current[1])

    return run


def checkpoint(function, *args, use_reentrant=True, preserve_rng_state=True, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` for torchacc tensors: ``function``'s activations are
    recomputed in backward; with ``preserve_rng_state`` the recompute sees the forward's device
    RNG state (dropout masks match) and CPU RNG state, and both are put back afterwards.
    ``use_reentrant=True`` (the default) recomputes behind a fence, so XLA cannot merge the
    recompute back into the forward and the activations are really freed (Note [Checkpointing
    that saves memory] in torchacc/lazy/checkpoint.py)."""
    fn = _replaying(function, preserve_rng_state)
    if use_reentrant:
        return _fenced.checkpoint(fn, *args, preserve_rng_state=False, **kwargs)
    return _torch_checkpoint.checkpoint(
        fn, *args, use_reentrant=use_reentrant, preserve_rng_state=False, **kwargs
    )
