"""``torch_xla.experimental.scan`` on torchacc: ``scan`` is torchacc/lazy/scan.py's."""

from __future__ import annotations

from torchacc.lazy.scan import scan as _scan
from torchacc.torch_xla._api import differs


@differs(
    "one lax.scan on torchacc tensors; random ops (dropout) inside fn are refused, and so are "
    "tensors fn closes over (pass them in init/xs)"
)
def scan(fn, init, xs, partition_fn=None, is_fn_pure=False):
    """torch_xla's ``scan(fn, init, xs)``: Note [Scan bodies] in torchacc/lowering/scan.py."""
    return _scan(fn, init, xs, partition_fn=partition_fn, is_fn_pure=is_fn_pure)


__all__ = ["scan"]
