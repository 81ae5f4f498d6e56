"""Factory ops with ``device=torchacc`` (no tensor argument) routed into the recorder.

The dispatcher picks a kernel for ``torch.empty(..., device=dev)`` from the device argument, so
these ops get PrivateUse1 kernels; composite factories (zeros, ones, full, rand, arange, ...) reach
them as ``empty`` followed by an in-place fill that the recorder handles like any op.
"""

import torch

from torchacc import dispatch

_lib = torch.library.Library("aten", "IMPL")
aten = torch.ops.aten

for _op in (aten.empty.memory_format, aten.empty_strided.default):

    def _kernel(*args, _op=_op, **kwargs):
        return dispatch.dispatch(_op, args, kwargs)

    _lib.impl(_op, _kernel, "PrivateUse1")


def _copy_from(src, dst, non_blocking=False):
    """Host -> device copies made by torch itself (``torch.tensor(data, device=dev)``)."""
    return dispatch.dispatch(aten.copy_.default, (dst, src), {})


_lib.impl(aten._copy_from.default, _copy_from, "PrivateUse1")
