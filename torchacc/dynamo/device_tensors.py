"""Dynamo sees torchacc-device tensors as plain tensors of that device (torch.compile over them).

Note [torch.compile over torchacc tensors]
A torchacc-device tensor is a Python tensor subclass with its own ``__torch_dispatch__`` (the lazy
frontend's LazyTensor) and no ``__tensor_flatten__``. Dynamo models such a tensor as an arbitrary
Python object: it traced into the lazy frontend's recorder, broke the graph at every op, and the
model ran on the lazy frontend, op by op, whatever the backend. torch_xla's tensors are C++
tensors on the ``xla`` device, which dynamo fakes like any other: ``install()`` gives torchacc's
tensors that treatment. Dynamo's ``VariableBuilder`` wraps the tensor class the lazy frontend
registered (engine/handoff.py) as it wraps ``torch.Tensor``: a FakeTensor of the same shape,
dtype and device (``torchacc:0``), a graph input with dynamo's tensor guards, no subclass
tracking. AOTAutograd then traces the captured graph on those fake tensors (the lazy frontend's
autograd-level kernels run there too: ``linear`` becomes ``torchacc::linear``), and the backend
(aot.py) lowers the forward and backward graphs like any other; lower.py hands the real tensors'
``jax.Array`` s to the program and wraps its results as torchacc tensors (Note [Device tensors in
a trace-once program] in engine/handoff.py). In SPMD mode the program takes each argument's
sharding as it is (one executable per set of argument shardings, so a step whose inputs keep
their layouts compiles once), XLA's propagation gives the results theirs, and ``mark_sharding``
inside the compiled region is a ``torchacc::shard`` node (``with_sharding_constraint``).
The runtime half: a gradient flowing into the compiled backward is a LazyTensor where AOTAutograd
traced a plain tensor; ``LazyTensor.__coerce_same_metadata_as_tangent__`` says it is one.

``install()`` runs when ``torchacc.dynamo`` loads (``backend="torchacc"`` imports it before dynamo
traces anything) and, through ``torchacc``'s post-import hook, whenever ``torch._dynamo`` is
imported after ``torchacc`` (so other backends, torch_xla's ``"openxla"`` through the alias
included, see the same graphs). It edits two private tables of dynamo; where they are missing (a
torch that moved them) it warns once and counts ``DynamoLazyFallback``: dynamo then traces into
the lazy frontend as before, and the model runs there.
"""

from __future__ import annotations

import warnings

import torch

from torchacc import metrics
from torchacc.engine import handoff

_installed = [None]  # the tensor class dynamo was taught, or False after a failed try


def install():
    """Teach dynamo to fake torchacc-device tensors as plain tensors (idempotent). Returns
    whether it now does."""
    cls = handoff.tensor_type[0]
    if cls is None:
        return False  # the lazy frontend is not loaded: no torchacc tensor can exist
    if _installed[0] is not None:
        return _installed[0] is cls
    try:
        from torch._dynamo.variables import builder

        vb = builder.VariableBuilder
        wrap = vb.wrap_tensor
        for trace_numpy in (False, True):
            table = vb._type_dispatch_impl(trace_numpy)
            if table.get(torch.Tensor) is not wrap:
                raise AttributeError("VariableBuilder's type table has no torch.Tensor entry")
            table[cls] = wrap
        infer = builder.infer_subclass_type
    except (AttributeError, ImportError, TypeError) as e:
        _installed[0] = False
        metrics.counter_inc("DynamoLazyFallback")
        warnings.warn(
            f"torchacc.dynamo: cannot teach this torch's dynamo ({torch.__version__}) to see "
            f"torchacc-device tensors as tensors ({e}); torch.compile over them runs on the lazy "
            "frontend (counted as 'DynamoLazyFallback')",
            stacklevel=2,
        )
        return False

    def infer_subclass_type(value):
        if type(value) is cls:
            return None  # a plain tensor of the torchacc device
        return infer(value)

    builder.infer_subclass_type = infer_subclass_type
    _installed[0] = cls
    return True
