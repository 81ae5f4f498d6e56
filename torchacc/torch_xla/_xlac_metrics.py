"""The metrics calls of ``torch_xla._XLAC`` on torchacc (counter and metric names, values,
reports, clearing, executed fallbacks), over ``torch_xla.debug.metrics``; ``_XLAC`` names them
from here so that its own module stays short."""

from __future__ import annotations


def _met():
    from torchacc.torch_xla.debug import metrics

    return metrics


def _xla_counter_names():
    return _met().counter_names()


def _xla_counter_value(name):
    return _met().counter_value(name)


def _xla_metric_names():
    return _met().metric_names()


def _xla_metric_data(name):
    return _met().metric_data(name)


def _xla_metrics_report():
    return _met().metrics_report()


def _short_xla_metrics_report(counter_names, metric_names):
    return _met().short_metrics_report(counter_names, metric_names)


def _clear_xla_counters():
    _met().clear_counters()


def _clear_xla_metrics():
    _met().clear_metrics()


def _get_executed_fallback_ops():
    return _met().executed_fallback_ops()


def _xla_increment_counter(name, value):
    from torchacc import metrics

    metrics.counter_inc(name, value)
