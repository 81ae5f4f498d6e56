"""``TORCHACC_DEBUG=1``: tag every recorded op with the user's line, to explain recompiles.

With the variable set when torchacc is imported, ``__torch_dispatch__`` is wrapped: each op the
user's code dispatches (the outermost dispatch, not the ops it decomposes into) notes the range of
node numbers it recorded and the user's line (Note [Trigger sites] in torchacc/engine/sites.py),
so a recompile can say where the op that differs was recorded. This costs a stack walk per op,
which is why it is only installed in debug mode: without it the recording path is untouched.
Also names the device RNG state for messages (Note [Naming graph inputs]).
"""

from __future__ import annotations

from torchacc.engine import explain, names, sites
from torchacc.ir.graph import _next_seq
from torchacc.lazy import random as device_random
from torchacc.lazy.tensor import LazyTensor


def _rng_name():
    st = device_random._storage
    return {} if st is None else {id(st): (st, "the device RNG state")}


names.extra_namers.append(_rng_name)


def install():
    """Wrap ``LazyTensor.__torch_dispatch__`` to tag ops with the user's line (debug mode only)."""
    if not explain.debug() or getattr(LazyTensor, "_tags_op_sites", False):
        return
    inner = LazyTensor.__dict__["__torch_dispatch__"].__func__
    depth = [0]

    def tagging_dispatch(cls, func, types, args=(), kwargs=None):
        if depth[0]:
            return inner(cls, func, types, args, kwargs)
        depth[0] = 1
        first = _next_seq()
        try:
            return inner(cls, func, types, args, kwargs)
        finally:
            depth[0] = 0
            explain.tag_ops(first, _next_seq(), sites.user_site(sites.caller(1)))

    LazyTensor.__torch_dispatch__ = classmethod(tagging_dispatch)
    LazyTensor._tags_op_sites = True
