"""``torch_xla.experimental.assume_pure`` on torchacc: a pure function traced once and recorded as
one node per call (torchacc/lazy/region.py's ``assume_pure``)."""

from __future__ import annotations

from torchacc.lazy import region
from torchacc.torch_xla._api import differs, not_implemented, not_implemented_class

# torch_xla's trace cache; clearing it makes the next call of every cached function retrace
_XLA_COMPUTATION_CACHE: dict = {}


@differs(
    "cached per function and input signature (shapes, dtypes, non-tensor values), not per "
    "function name; differentiable (torch_xla's is forward only)"
)
def assume_pure_torch(func, use_cache=False):
    """``func`` traced on the torchacc device (once per input signature with ``use_cache``, on
    every call without) and run as one recorded node; tensors it closes over are read live."""
    return region.assume_pure(func, use_cache=use_cache, cache=_XLA_COMPUTATION_CACHE)


@differs(
    "traced with torch (not torchax); the backward recomputes the forward it needs; "
    "add_rng_seed_argument is not implemented"
)
def assume_pure(fn, *, add_rng_seed_argument=False):
    """torch_xla's ``assume_pure`` (which goes through torchax and JAX): here the same traced
    node as ``assume_pure_torch``; differentiable."""
    if add_rng_seed_argument:
        raise NotImplementedError(
            "torch_xla.experimental.assume_pure: add_rng_seed_argument=True is not implemented "
            "on torchacc (random ops inside a traced region are refused)"
        )
    return region.assume_pure(fn, use_cache=True, cache=_XLA_COMPUTATION_CACHE)


j2t_autograd = not_implemented(
    "torch_xla.experimental.assume_pure.j2t_autograd", "JAX functions run via torchax; none here"
)
PureModule = not_implemented_class(
    "torch_xla.experimental.assume_pure.PureModule", "not implemented yet; use assume_pure"
)

__all__ = ["assume_pure", "assume_pure_torch", "PureModule", "j2t_autograd"]
