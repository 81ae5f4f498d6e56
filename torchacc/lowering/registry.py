"""The lowering table: ATen overloads -> JAX functions, one decorator per rule.

A rule is called while JAX traces a compiled step. It receives the ATen op's own arguments, in the
same positions and keywords, with these substitutions (see Note [Rule calling convention]):

- every ``Tensor`` argument (also inside ``Tensor[]`` / ``Tensor?[]`` lists) is a ``jax.Array``;
- every ``Scalar`` / ``float`` argument is a traced 0-d ``jax.Array`` (float64, int64 or bool) so a
  value that changes every step (learning rate, loss scale) never recompiles. Arguments named in
  ``static=`` stay Python values instead (use it when the value decides a shape or a branch);
- everything else (ints, int lists, bools, dtypes, strings, None) is the Python value.

The rule returns a ``jax.Array`` or a tuple matching the op's outputs. The core casts each output to
the dtype PyTorch's meta kernel reports and checks its shape, so a wrong shape fails loudly with the
op's name at compile time.

Options:
- ``static=("name", ...)``: Scalar/float arguments that stay Python values.
- ``out_meta=True``: the rule gets ``out=[(shape, jnp_dtype), ...]`` as a keyword (factories).
- ``rng=True``: the rule gets ``rng=<jax PRNG key>`` as a keyword (the core threads RNG state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# Note [Rule calling convention]
# Rules are plain functions of jax arrays and Python values; they never see LazyTensors, graphs
# or devices. That keeps each rule testable on its own (tests/lowering_harness.py compares a rule
# against the eager PyTorch op on CPU) and lets the compiler replay a recorded graph by calling
# rules in order inside one jax.jit. Scalars arrive as traced arrays: a rule must not branch in
# Python on them.


@dataclass(frozen=True)
class Rule:
    fn: Callable
    static: frozenset
    out_meta: bool
    rng: bool
    name: str


RULES: dict = {}


def _overloads(op):
    """Expand an OpOverloadPacket into all its overloads; keep an OpOverload as is."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def register(*ops, static=(), out_meta=False, rng=False):
    """Decorator: register ``fn`` as the lowering of each ATen overload (or packet) in ``ops``."""

    def wrap(fn):
        for op in ops:
            for overload in _overloads(op):
                RULES[overload] = Rule(fn, frozenset(static), out_meta, rng, str(overload))
        return fn

    return wrap


def lookup(op):
    """The rule for an OpOverload, or None."""
    return RULES.get(op)


_SCALAR_TYPES = ("number", "float", "Optional[number]", "Optional[float]")
_SCALAR_LIST_TYPES = ("List[number]", "List[float]")


def scalar_arguments(op, static=frozenset()):
    """Names of ``op``'s arguments that are lifted to runtime scalars, with whether each is a list.

    Returns a dict name -> (position or None for keyword-only, is_list).
    """
    lifted = {}
    position = 0
    for arg in op._schema.arguments:
        kind = str(arg.type)
        pos = None if arg.kwarg_only else position
        if not arg.kwarg_only:
            position += 1
        if arg.name in static:
            continue
        if kind in _SCALAR_TYPES:
            lifted[arg.name] = (pos, False)
        elif kind in _SCALAR_LIST_TYPES:
            lifted[arg.name] = (pos, True)
    return lifted
