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


def manual_seed(seed):
    global _storage
    value = Value(KEY_DESC, array=put(key_data(int(seed))))
    if _storage is None:
        _storage = Storage(value, KEY_DESC)
    else:
        _storage.write(value)


def state_value():
    if _storage is None:
        manual_seed(torch.initial_seed())
    return _storage.value


def advance(node, index):
    """Register output ``index`` of random ``node`` as the next key."""
    _storage.write(Value(KEY_DESC, node, index))
