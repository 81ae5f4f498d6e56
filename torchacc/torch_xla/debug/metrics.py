"""``torch_xla.debug.metrics`` (``met``) on torchacc, with torch_xla's names and units.

Counters and timings come from :mod:`torchacc.metrics` (whose names already follow torch_xla:
``MarkStep``, ``UncachedCompile``, ``CachedCompile``, ``TransferToDevice``, ``TransferFromDevice``,
``aten::<op>`` for CPU fallbacks, ``CompileTime``, ``ExecuteTime``, ``TransferToDeviceTime``,
``TransferFromDeviceTime``). torch_xla names for the same ideas are answered too:
``CreateCompileHandles`` (executables created: compiled or loaded from the persistent cache),
``LazyTracing`` (host time tracing a step = ``TraceTime``), ``TensorToData`` (uploads =
``TransferToDeviceTime``). As in torch_xla, :func:`metric_data` gives
``(total_samples, accumulator, [(time, value), ...])`` with times in nanoseconds, and a counter or
metric that never fired is ``None``. Per-op IR counters (``xla::add``, ``xla::mm``) count the
nodes recorded per ATen op (torchacc/lazy/op_counters.py).
"""

from __future__ import annotations

from torchacc import metrics as _m

COUNTER_ALIASES = {"CreateCompileHandles": ("UncachedCompile", "PersistentCacheHit")}
METRIC_ALIASES = {"LazyTracing": "TraceTime", "TensorToData": "TransferToDeviceTime"}

clear_all = _m.clear_all
clear_counters = _m.clear_counters
clear_metrics = _m.clear_metrics
executed_fallback_ops = _m.executed_fallback_ops
metrics_report = _m.metrics_report
explain_report = _m.explain_report  # torchacc's: why each compile and sync happened
explain_summary = _m.explain_summary


def counter_value(name):
    """A counter's value (an int), or None if it never fired."""
    sources = COUNTER_ALIASES.get(name)
    if sources is None:
        return _m.counter_value(name)
    values = [_m.counter_value(s) for s in sources]
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def counter_names():
    names = _m.counter_names()
    aliases = [a for a in COUNTER_ALIASES if counter_value(a) is not None]
    return sorted(names + aliases)


def metric_names():
    names = _m.metric_names()
    aliases = [a for a, src in METRIC_ALIASES.items() if src in names]
    return sorted(names + aliases)


def metric_data(name):
    """``(total_samples, accumulator_ns, [(wall_time_ns, value_ns), ...])`` or None."""
    samples = _m.metric_samples(METRIC_ALIASES.get(name, name))
    if not samples:
        return None
    scale = 1 if name in _m.VALUE_METRICS else 1e9  # bytes and counts stay as they are
    ns = [(stamp * 1e9, seconds * scale) for stamp, seconds in samples]
    return len(ns), sum(v for _, v in ns), ns


def short_metrics_report(counter_names=None, metric_names=None):
    return _m.short_metrics_report(counter_names, metric_names)


__all__ = [
    "clear_all",
    "clear_counters",
    "clear_metrics",
    "counter_names",
    "counter_value",
    "executed_fallback_ops",
    "explain_report",
    "explain_summary",
    "metric_data",
    "metric_names",
    "metrics_report",
    "short_metrics_report",
]
