"""``torch_xla.core.xla_op_registry`` (``xor``): operations whose lowering is written with
torch_xla's XlaBuilder API (``xor.register(name, opfn)``).

The module and its names exist so that scripts import unchanged; building a computation op by op
needs torch_xla's C++ XlaBuilder bindings, so calling a registered op raises
``NotImplementedError``. torchacc's way to run a hand-written lowering is a JAX function:
``torch_xla.core.xla_builder.call_jax``.
"""

from __future__ import annotations

from torchacc.torch_xla._api import differs, not_implemented
from torchacc.torch_xla.core import xla_builder as xb

_REASON = (
    "its lowering function is written with torch_xla's C++ XlaBuilder bindings, which torchacc "
    "does not have; write it as a JAX function and call it with xb.call_jax"
)


@differs("constructs; calling the op raises NotImplementedError (XlaBuilder lowering)")
class Op:
    """An operation registered by name; calling it raises ``NotImplementedError``."""

    def __init__(self, name, opfn):
        self._name = name
        self._opfn = opfn
        self._opname = "xla::_op_" + name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"xor.register({self._name!r}): {_REASON}")


@differs("registers the name; calling the op raises NotImplementedError (XlaBuilder lowering)")
def register(name, opfn):
    """Register ``opfn`` (an XlaBuilder lowering) as op ``name``; the op raises when called."""
    return Op(name, opfn)


call_jax = xb.call_jax
tensor_shape = not_implemented("xor.tensor_shape", _REASON)

__all__ = ["Op", "call_jax", "register"]
