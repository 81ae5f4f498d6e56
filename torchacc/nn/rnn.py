"""torch's RNN modules (``nn.RNN``/``nn.LSTM``/``nn.GRU``) under torchacc's parameter-swap policy.

``import torchacc`` turns on torch's ``swap_module_params_on_conversion``, so ``load_state_dict``
swaps each parameter's contents in place (``torch.utils.swap_tensors``). An RNN keeps weak
references to its weights, and a tensor with a weak reference cannot be swapped, so loading a
state dict into any RNN failed. :func:`install` lets ``RNNBase._load_from_state_dict`` drop those
references for the load and rebuild them after (what ``RNNBase._apply`` already does for
``.to()``).
"""

from __future__ import annotations

import functools

from torch.nn.modules.rnn import RNNBase


def install():
    """Idempotent."""
    load = RNNBase._load_from_state_dict
    if getattr(load, "_torchacc_swap_safe", False):
        return

    @functools.wraps(load)
    def _load_from_state_dict(self, *args, **kwargs):
        self._flat_weight_refs = []
        try:
            return load(self, *args, **kwargs)
        finally:
            self._init_flat_weights()

    _load_from_state_dict._torchacc_swap_safe = True
    RNNBase._load_from_state_dict = _load_from_state_dict
