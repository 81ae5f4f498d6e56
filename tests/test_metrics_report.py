"""short_metrics_report() lists the aten::* CPU-fallback counters, as torch_xla's does (19.6)."""

from __future__ import annotations

import torch

import torchacc
import torchacc.torch_xla.debug.metrics as met


def test_short_report_lists_fallback_counters():
    met.clear_all()
    x = torch.tensor([0.0, 1.0, 0.0, 2.0], device=torchacc.device())
    idx = torch.nonzero(x * 2)  # data-dependent shape: runs as a CPU fallback
    torchacc.sync()
    assert idx.cpu().flatten().tolist() == [1, 3]
    fallbacks = met.executed_fallback_ops()
    assert "aten::nonzero" in fallbacks
    report = met.short_metrics_report()
    for name in fallbacks:
        assert f"Counter: {name}: {met.counter_value(name)}" in report
    assert "Counter: aten::" not in met.short_metrics_report(["MarkStep"])  # explicit names only
