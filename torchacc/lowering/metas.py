"""Meta kernels (output shapes and dtypes) for ATen ops torch ships without one, so the recorder
can record them: ``histogram`` (both forms) and ``geqrf``. Registered only where torch has no
Meta kernel of its own.
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


for _name, _fn in (
    ("histogram.bin_ct", _histogram_bin_ct),
    ("histogram.bins_tensor", _histogram_bins_tensor),
    ("geqrf", _geqrf),
):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", "Meta"):
        _lib.impl(_name, _fn, "Meta")
