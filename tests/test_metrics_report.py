"""short_metrics_report() lists the aten::* CPU-fallback counters, as torch_xla's does (19.6)."""

from __future__ import annotations

import json
import os

import prewarmed
import pytest
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


def test_step_timings_measure_what_the_readme_says():
    """TraceTime is the host time between syncs, SyncTime a sync's own time, ExecuteTime the
    launch of each program run inside it (README, "Metrics"): one sample each, real durations."""
    import time

    met.clear_all()
    x = torch.ones(4, device=torchacc.device())
    torchacc.sync()
    spans = []
    for _ in range(3):
        time.sleep(0.05)  # "tracing": host time between two syncs
        x = x * 2 + 1
        start = time.perf_counter()
        torchacc.sync()
        spans.append(time.perf_counter() - start)
    assert x.cpu().tolist() == [15.0] * 4
    assert met.counter_value("MarkStep") == 4
    # torchacc.metrics gives seconds (the torch_xla view above gives nanoseconds)
    n, _, trace = torchacc.metrics.metric_data("TraceTime")
    assert n == 4 and all(t >= 0.05 for t in trace[1:]), trace  # [0]: since an earlier sync
    n, _, syncs = torchacc.metrics.metric_data("SyncTime")
    assert n == 4 and all(0 < s <= w for s, w in zip(syncs[1:], spans)), (syncs, spans)
    n, _, execs = torchacc.metrics.metric_data("ExecuteTime")
    assert n == 4 and all(0 < e <= s for e, s in zip(execs, syncs)), (execs, syncs)
    n, total_ns, _ = met.metric_data("ExecuteTime")
    assert n == 4 and abs(total_ns - 1e9 * sum(execs)) < 1e3


_TWICE = """
import json, torch, torchacc
from torchacc import metrics
x = torch.arange(7.0).to(torchacc.device())
y = (x * 3 + 1).sum()
torchacc.sync()
c = metrics.counter_value
print(json.dumps([y.item(), c("UncachedCompile") or 0, c("PersistentCacheHit") or 0]))
"""


@pytest.mark.slow
def test_second_run_of_a_script_compiles_nothing(tmp_path):
    """README (TORCHACC_CACHE_DIR): a second run of the same script compiles nothing. The first
    run of a fresh cache counts its programs as UncachedCompile only; the second finds each on
    disk and counts it as PersistentCacheHit only."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        TORCHACC_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.path.join(os.path.dirname(__file__), ".."),
    )
    runs = []
    for _ in range(2):
        out = prewarmed.run(["-c", _TWICE], env=env, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    (v1, uncached1, hits1), (v2, uncached2, hits2) = runs
    assert v1 == v2 == 70.0
    assert uncached1 >= 1 and hits1 == 0, runs
    assert uncached2 == 0 and hits2 == uncached1, runs
