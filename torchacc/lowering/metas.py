"""Meta kernels (output shapes and dtypes) for ATen ops torch ships without one, so the recorder
can record them: ``histogram`` (both forms), ``geqrf`` and ``linalg_lstsq``. Registered only
where torch has no Meta kernel of its own.
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("aten", "IMPL")


def _histogram_bin_ct(self, bins=100, *, range=None, weight=None, density=False):
    return self.new_empty((bins,)), self.new_empty((bins + 1,))


def _histogram_bins_tensor(self, bins, *, weight=None, density=False):
    return self.new_empty((bins.numel() - 1,)), bins.new_empty(bins.shape)


def _geqrf(self):
    m, n = self.shape[-2:]
    return self.new_empty(self.shape), self.new_empty(self.shape[:-2] + (min(m, n),))


def _lstsq(self, b, rcond=None, *, driver=None):
    """Shapes as eager CPU gives them; the SVD drivers' residuals exist only for full-rank input
    (a data-dependent shape), so those stay unrecorded (a counted CPU fallback)."""
    driver = driver or "gelsy"
    if driver not in ("gelsy", "gels"):
        raise NotImplementedError(f"linalg.lstsq(driver={driver!r}): data-dependent shapes")
    m, n = self.shape[-2:]
    vector = b.dim() == self.dim() - 1
    k = () if vector else b.shape[-1:]
    batch = torch.broadcast_shapes(self.shape[:-2], b.shape[: b.dim() - (1 if vector else 2)])
    solution = self.new_empty(batch + (n,) + k)
    empty = self.new_empty((0,))
    if driver == "gels":
        residuals = self.new_empty(batch + k) if m > n else empty
        return solution, residuals, self.new_empty((0,), dtype=torch.int64), empty
    return solution, empty, self.new_empty(batch, dtype=torch.int64), empty


for _name, _fn in (
    ("histogram.bin_ct", _histogram_bin_ct),
    ("histogram.bins_tensor", _histogram_bins_tensor),
    ("geqrf", _geqrf),
    ("linalg_lstsq", _lstsq),
):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", "Meta"):
        _lib.impl(_name, _fn, "Meta")
