"""``torch_xla.core.xla_builder`` (``xb``) on torchacc.

``call_jax(jax_func, args, kwargs)`` works: torchacc tensors in ``args``/``kwargs`` are synced and
passed to ``jax_func`` as JAX arrays; the results come back as torchacc tensors. Unlike torch_xla it
runs at once (the inputs' pending step is computed first) instead of being traced into the step.
Building XLA computations op by op (``Op``, ``create_computation``, ``mkop``, ...) needs torch_xla's
C++ XlaBuilder bindings and raises ``NotImplementedError``.
"""

from __future__ import annotations

import jax
import torch

import torchacc
from torchacc.lazy.device import DEVICE_TYPE
from torchacc.torch_xla._api import differs, not_implemented, not_implemented_class

_NO_BUILDER = (
    "building XLA computations op by op needs torch_xla's C++ XlaBuilder bindings; write the "
    "computation as a JAX function and use xb.call_jax"
)


def _to_jax(x):
    from torchacc.lazy.record import value_of

    if isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE:
        value = value_of(x)
        if value.node is not None:
            torchacc.sync()
            value = value_of(x)
        return value.array
    return x


def _to_torch(x):
    from torchacc import metrics
    from torchacc.ir import Value, contiguous_desc
    from torchacc.lazy.record import fresh
    from torchacc.lazy.tensor import LazyTensor

    if isinstance(x, jax.Array):
        import numpy as np

        if x.dtype.name == "bfloat16":
            dtype = torch.bfloat16
        else:
            dtype = torch.from_numpy(np.zeros((), dtype=x.dtype)).dtype
        metrics.counter_inc("CallJax")
        out = fresh(Value(contiguous_desc(tuple(x.shape), dtype), array=x))
        assert isinstance(out, LazyTensor)
        return out
    return x


@differs("runs at once: syncs the inputs' pending step, then calls the JAX function eagerly")
def call_jax(jax_func, args, kwargs=None, name=None, override_hash=None):
    """``jax_func(*args, **kwargs)`` with torchacc tensors as JAX arrays and back."""
    leaves, tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs or {})))
    jargs, jkwargs = jax.tree_util.tree_unflatten(tree, [_to_jax(x) for x in leaves])
    out = jax.jit(jax_func)(*jargs, **jkwargs)
    return jax.tree_util.tree_map(_to_torch, out)


Type = not_implemented_class("xb.Type", _NO_BUILDER)
Shape = not_implemented_class("xb.Shape", _NO_BUILDER)
Op = not_implemented_class("xb.Op", _NO_BUILDER)
create_builder = not_implemented("xb.create_builder", _NO_BUILDER)
mkshape = not_implemented("xb.mkshape", _NO_BUILDER)
mkop = not_implemented("xb.mkop", _NO_BUILDER)
mkleaf = not_implemented("xb.mkleaf", _NO_BUILDER)
mkparam = not_implemented("xb.mkparam", _NO_BUILDER)
tensor_shape = not_implemented("xb.tensor_shape", _NO_BUILDER)
create_computation = not_implemented("xb.create_computation", _NO_BUILDER)
computation_from_module_proto = not_implemented("xb.computation_from_module_proto", _NO_BUILDER)
get_computation_hlo = not_implemented("xb.get_computation_hlo", _NO_BUILDER)
xla_computation_as_func = not_implemented("xb.xla_computation_as_func", _NO_BUILDER)
create_placeholder_tensor = not_implemented("xb.create_placeholder_tensor", _NO_BUILDER)
