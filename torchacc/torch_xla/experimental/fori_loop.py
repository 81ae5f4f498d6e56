"""``torch_xla.experimental.fori_loop`` on torchacc: ``fori_loop`` and torch's ``while_loop`` on
torchacc tensors as one ``lax.while_loop`` (torchacc/lazy/region.py).

Importing it makes ``torch._higher_order_ops.while_loop.while_loop`` take torchacc tensors (as
importing torch_xla's module registers its XLA kernel for the op); on other tensors it is torch's.
"""

from __future__ import annotations

import sys

import torch
import torch._higher_order_ops.while_loop  # noqa: F401  (the module, below)
from torch.utils._pytree import tree_flatten

from torchacc.lazy import region
from torchacc.lazy.tensor import LazyTensor
from torchacc.torch_xla._api import differs

_NOTE = "forward only (no autograd through the loop); carried inputs must be tensors"


@differs(_NOTE + "; additional_inputs are passed to both functions after the carried ones")
def while_loop(cond_fn, body_fn, carried_inputs, additional_inputs=None):
    """torch_xla's ``while_loop`` kernel: ``cond_fn``/``body_fn`` take ``(*carried,
    *additional_inputs)``; body_fn returns the new carried values."""
    extra = list(additional_inputs or ())
    return region.while_loop(cond_fn, body_fn, tuple(carried_inputs), additional_inputs=extra)


@differs(_NOTE)
def fori_loop(lower, upper, body_fun, *input_value):
    """``body_fun(*values) -> values`` run ``upper - lower`` times; returns
    ``[0, *final values]`` (torch_xla's layout: the spent counter first)."""
    device = next((v.device for v in input_value if isinstance(v, torch.Tensor)), None)
    if not isinstance(upper - lower, torch.Tensor):
        count = torch.tensor(int(upper - lower), device=device)
    else:
        count = (upper - lower).to(device)
    if int(upper - lower) < 0:
        raise ValueError(f"fori_loop: upper ({upper}) is below lower ({lower})")

    def body(i, *values):
        new = body_fun(*values)
        return (i - 1, *(new if isinstance(new, (tuple, list)) else (new,)))

    return list(region.while_loop(lambda i, *values: i > 0, body, (count, *input_value)))


def _torch_while_loop(original):
    def while_loop(cond_fn, body_fn, carried_inputs):
        leaves = tree_flatten(carried_inputs)[0]
        if any(type(v) is LazyTensor for v in leaves):
            return region.while_loop(cond_fn, body_fn, carried_inputs)
        return original(cond_fn, body_fn, carried_inputs)

    while_loop.__doc__ = original.__doc__
    while_loop._torchacc_original = original
    return while_loop


def install():
    """Let torch's ``while_loop`` take torchacc tensors (idempotent)."""
    module = sys.modules["torch._higher_order_ops.while_loop"]
    if not hasattr(module.while_loop, "_torchacc_original"):
        module.while_loop = _torch_while_loop(module.while_loop)
    package = sys.modules["torch._higher_order_ops"]
    if getattr(package, "while_loop", None) is module.while_loop._torchacc_original:
        package.while_loop = module.while_loop


install()

__all__ = ["fori_loop", "while_loop"]
