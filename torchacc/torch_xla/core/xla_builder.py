"""``torch_xla.core.xla_builder`` (``xb``) on torchacc.

``call_jax(jax_func, args, kwargs)`` works: torchacc tensors in ``args``/``kwargs`` are
``jax_func``'s JAX arrays and the results come back as torchacc tensors; as in torch_xla the call
is traced into the step (one ``torchacc.call_jax`` node, torchacc/lowering/region.py).
Building XLA computations op by op (``Op``, ``create_computation``, ``mkop``, ...) needs torch_xla's
C++ XlaBuilder bindings and raises ``NotImplementedError``.
"""

from __future__ import annotations

import jax
import torch

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.torch_xla._api import differs, not_implemented, not_implemented_class

_NO_BUILDER = (
    "building XLA computations op by op needs torch_xla's C++ XlaBuilder bindings; write the "
    "computation as a JAX function and use xb.call_jax"
)


# torch_xla's trace cache of call_jax: (function, argument tree, shapes, static values, JAX
# config) -> the registered JAX call; clearing it makes the next call of each function retrace
_JAX_TO_XLA_COMPUTATION_CACHE: dict = {}


def _jax_to_xla_computation_cache_elements():
    return len(_JAX_TO_XLA_COMPUTATION_CACHE)


def _static_key(value):
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


@differs("the call is one node of the recorded step (its JAX function traced into the program)")
def call_jax(jax_func, args, kwargs=None, name=None, override_hash=None):
    """``jax_func(*args, **kwargs)`` on the device: torchacc tensors in ``args``/``kwargs`` are its
    JAX arrays, other leaves static Python values; the results come back as torchacc tensors
    (same pytree). Recorded as one ``torchacc.call_jax`` node, no autograd through it."""
    from torchacc import metrics
    from torchacc.lowering import region
    from torchacc.lowering.dtypes import jdtype, tdtype

    leaves, tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs or {})))
    pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    for i in pos:  # torchacc tensors, or the fakes of a traced region (assume_pure, ...)
        if leaves[i].device.type != DEVICE_TYPE:
            raise ValueError(
                f"xb.call_jax: argument leaf {i} is a {leaves[i].device} tensor; call_jax takes "
                "torchacc tensors (move it with .to(device))"
            )
    statics = {i: x for i, x in enumerate(leaves) if i not in pos}
    precision = jax.config.jax_default_matmul_precision
    key = (
        jax_func if override_hash is None else ("hash", override_hash),
        tree,
        tuple((tuple(leaves[i].shape), leaves[i].dtype) for i in pos),
        tuple((i, _static_key(v)) for i, v in statics.items()),
        precision,
    )
    call = _JAX_TO_XLA_COMPUTATION_CACHE.get(key)
    if call is None:
        specs = [jax.ShapeDtypeStruct(tuple(leaves[i].shape), jdtype(leaves[i].dtype)) for i in pos]

        def shaped(*arrays):
            merged = list(leaves)
            for i, a in zip(pos, arrays):
                merged[i] = a
            a, k = jax.tree_util.tree_unflatten(tree, merged)
            return jax_func(*a, **k)

        with jax.default_matmul_precision(precision):
            out = jax.eval_shape(shaped, *specs)
        outs, out_tree = jax.tree_util.tree_flatten(out)
        meta = [(tuple(o.shape), tdtype(o.dtype)) for o in outs]
        call = region.JaxCall(jax_func, tree, pos, statics, precision, meta, out_tree)
        _JAX_TO_XLA_COMPUTATION_CACHE[key] = call
    results = region.call_jax([leaves[i] for i in pos], call.key)
    metrics.counter_inc("CallJax", len(results))
    return jax.tree_util.tree_unflatten(call.out_tree, list(results))


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
