"""Counters and timings, named like torch_xla's where the idea is the same.

Counters: ``MarkStep``, ``UncachedCompile`` (an XLA compile really ran), ``CachedCompile`` (the
in-memory cache had the step), ``PersistentCacheHit`` (the on-disk cache spared a compile),
``TransferToDevice`` / ``TransferFromDevice`` (host<->device copies) and ``aten::<op>`` (an op ran
eagerly on CPU because it has no lowering: a fallback).
Timings (seconds): ``TraceTime`` (host time spent recording a step: from the end of the previous
sync to the start of this one), ``CompileTime``, ``ExecuteTime`` (launching the program; execution
itself is asynchronous), ``TransferToDeviceTime``, ``TransferFromDeviceTime``, ``SyncTime``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

_counters: dict = defaultdict(int)
_timings: dict = defaultdict(list)
_stamps: dict = defaultdict(list)  # wall-clock time (time.time()) of each timing sample


def counter_inc(name, n=1):
    _counters[name] += n


def counter_value(name):
    """Value of a counter, or None if it never fired (torch_xla's convention)."""
    return _counters.get(name)


def counter_names():
    return sorted(_counters)


def record_time(name, seconds):
    _timings[name].append(seconds)
    _stamps[name].append(time.time())


@contextlib.contextmanager
def timed(name):
    start = time.perf_counter()
    try:
        yield
    finally:
        record_time(name, time.perf_counter() - start)


def metric_names():
    return sorted(_timings)


def metric_data(name):
    """(number of samples, total seconds, list of samples) or None, like torch_xla's metric_data."""
    samples = _timings.get(name)
    if not samples:
        return None
    return len(samples), sum(samples), list(samples)


def metric_samples(name):
    """``[(wall-clock time, seconds), ...]`` of a timing (empty if it never fired)."""
    return list(zip(_stamps.get(name, ()), _timings.get(name, ())))


def executed_fallback_ops():
    return sorted(name for name in _counters if name.startswith("aten::"))


def clear_all():
    _counters.clear()
    clear_metrics()


def clear_metrics():
    """Forget the timings (counters stay)."""
    _timings.clear()
    _stamps.clear()


def clear_counters():
    _counters.clear()


def _fmt_seconds(s):
    if s < 1e-3:
        return f"{s * 1e6:.1f}us"
    if s < 1:
        return f"{s * 1e3:.2f}ms"
    return f"{s:.3f}s"


def metrics_report():
    """Readable text: every timing (count, total, mean, p50) then every counter."""
    lines = []
    for name in metric_names():
        samples = sorted(_timings[name])
        total = sum(samples)
        lines.append(f"Metric: {name}")
        lines.append(f"  TotalSamples: {len(samples)}")
        lines.append(f"  Accumulator: {_fmt_seconds(total)}")
        lines.append(f"  Mean: {_fmt_seconds(total / len(samples))}")
        lines.append(
            f"  Percentiles: 50%={_fmt_seconds(samples[len(samples) // 2])}; "
            f"max={_fmt_seconds(samples[-1])}"
        )
    for name in counter_names():
        lines.append(f"Counter: {name}")
        lines.append(f"  Value: {_counters[name]}")
    return "\n".join(lines) + "\n"


def short_metrics_report(counter_names_=None, metric_names_=None):
    names = counter_names_ or [
        "MarkStep",
        "UncachedCompile",
        "CachedCompile",
        "PersistentCacheHit",
        "TransferFromDevice",
    ]
    mnames = metric_names_ or ["CompileTime", "ExecuteTime", "TraceTime"]
    lines = []
    for name in mnames:
        data = metric_data(name)
        if data:
            lines.append(f"Metric: {name}: count={data[0]} total={_fmt_seconds(data[1])}")
    for name in names:
        if name in _counters:
            lines.append(f"Counter: {name}: {_counters[name]}")
    if counter_names_ is None:  # like torch_xla's: every op that fell back to the CPU
        for name in executed_fallback_ops():
            lines.append(f"Counter: {name}: {_counters[name]}")
    return "\n".join(lines) + "\n"
