"""Device-side RNG: one JAX PRNG key threaded through every random op of a step.

The key lives in a Storage like a tensor's, so a sync carries it from step to step on the device:
steps differ, and ``torch.manual_seed(s)`` (which calls ``manual_seed_all`` of the torchacc backend
module) makes runs reproduce. Each random node takes the current key data as its last input and
returns the next key data as its last output (the program splits the key: program/build.py).
"""

from __future__ import annotations

import torch

from torchacc.engine.transfer import put
from torchacc.ir import Storage, Value
from torchacc.runtime.rng import key_data

KEY_DESC = ((2,), (1,), torch.uint32, 0)
_storage = None
_pending_seed = None  # set by manual_seed, turned into the key by state_value


def manual_seed(seed):
    """Seed the device RNG (``torch.manual_seed`` calls this through the backend module).

    Only the seed is kept here; the key is built when a random op first needs it
    (:func:`state_value`). So ``torch.manual_seed`` in a script that merely imports torchacc does
    not start JAX (nor join a torchrun job through ``platform()``): it behaves as without torchacc.
    """
    global _pending_seed
    _pending_seed = int(seed)


def _materialize(seed):
    global _storage
    value = Value(KEY_DESC, array=put(key_data(int(seed))))
    if _storage is None:
        _storage = Storage(value, KEY_DESC)
    else:
        _storage.write(value)


def state_value():
    global _pending_seed
    if _pending_seed is not None:
        seed, _pending_seed = _pending_seed, None
        _materialize(seed)
    elif _storage is None:
        _materialize(torch.initial_seed())
    return _storage.value


def advance(node, index):
    """Register output ``index`` of random ``node`` as the next key."""
    _storage.write(Value(KEY_DESC, node, index))


def get_state():
    """The device RNG state as a Value (no host transfer): give it to :func:`set_state` to replay
    the same random numbers (activation checkpointing's recompute does)."""
    return state_value()


def set_state(value):
    """Make ``value`` (from :func:`get_state`) the device RNG state."""
    global _pending_seed
    state_value()  # the storage exists (and a pending seed is superseded)
    _pending_seed = None
    _storage.write(value)
