"""torch_xla's per-op IR counters (``xla::add``, ``xla::mm``): nodes recorded per ATen op.

Counted at record time at no extra lookup: every ``ir.Node`` bumps its OpEntry's ``calls`` (one
attribute increment per recorded op); the counters are summed over the cached OpEntries only when
someone reads them (``metrics.counter_names()``, ``counter_value("xla::add")``, the reports).
Batched ``_foreach_*`` nodes count once per list element, under the element op's name. An op that
runs eagerly on CPU instead (a fallback) is not recorded: it counts as ``aten::<op>`` only.
"""

from __future__ import annotations

from torchacc import metrics
from torchacc.lazy.record import _entries

PREFIX = "xla::"
_BATCHED = "batched "


def _name(rule_name):
    batched = rule_name.startswith(_BATCHED)
    parts = rule_name[len(_BATCHED) :].split(".") if batched else rule_name.split(".")
    return PREFIX + (parts[1] if len(parts) > 1 else parts[0]), batched


_names: dict = {}  # rule name -> (counter name, batched)


def values():
    """``{"xla::<op>": nodes recorded}`` since the last clear (ops with none left out)."""
    out: dict = {}
    for entry in list(_entries.values()):
        calls = getattr(entry, "calls", 0)
        if not calls:
            continue
        rule_name = entry.rule.name
        named = _names.get(rule_name)
        if named is None:
            named = _names[rule_name] = _name(rule_name)
        name, batched = named
        out[name] = out.get(name, 0) + (calls * len(entry.descs) if batched else calls)
    return out


def clear():
    for entry in list(_entries.values()):
        if getattr(entry, "calls", 0):
            entry.calls = 0


metrics.add_counter_source(PREFIX, values, clear)
