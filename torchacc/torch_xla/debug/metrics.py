"""``torch_xla.debug.metrics`` on torchacc: thin re-exports of :mod:`torchacc.metrics`.

Counter names follow torch_xla where the idea is the same (``MarkStep``, ``UncachedCompile``,
``CachedCompile``, ``TransferToDevice``, ``TransferFromDevice``, ``aten::<op>`` for CPU fallbacks).
"""

from torchacc import metrics as _m

counter_names = _m.counter_names
counter_value = _m.counter_value
metric_names = _m.metric_names
metric_data = _m.metric_data
clear_all = _m.clear_all
clear_counters = _m.clear_counters
executed_fallback_ops = _m.executed_fallback_ops
metrics_report = _m.metrics_report


def short_metrics_report(counter_names=None, metric_names=None):
    return _m.short_metrics_report(counter_names, metric_names)


def clear_metrics():
    _m.clear_all()


__all__ = [
    "clear_all",
    "clear_counters",
    "clear_metrics",
    "counter_names",
    "counter_value",
    "executed_fallback_ops",
    "metric_data",
    "metric_names",
    "metrics_report",
    "short_metrics_report",
]
