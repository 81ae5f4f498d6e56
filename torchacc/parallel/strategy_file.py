"""Strategy files: a YAML mapping of layer names to strategies, applied with ``shard()``.

Each key is a module name of the model (``fnmatch`` patterns allowed: ``h.*.mlp.c_fc``); its value
maps that module's parameter names to strategies (``weight: [2, 1]``), and may give
``in_strategy``/``out_strategy`` (lists of strategies, ``null`` for data parallel)::

    h.*.attn.c_attn: {weight: [2, 1], bias: [2]}
    h.*.attn.c_proj: {weight: [1, 2]}

A pattern that names no module, or a value that is not such a mapping, is a ``ValueError``.
"""

from __future__ import annotations

import fnmatch

from torchacc.parallel.module import shard

_IO = ("in_strategy", "out_strategy")


def load_strategy_file(path):
    """The mapping in the YAML file ``path`` (validated for shape, not against a model)."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"strategy file {path}: expected a mapping of layer names to strategies")
    for layer, entry in data.items():
        if not isinstance(entry, dict) or not all(
            isinstance(v, (list, tuple)) or (k in _IO and v is None) for k, v in entry.items()
        ):
            raise ValueError(
                f"strategy file {path}: {layer!r} must map parameter names to strategies (lists "
                f"of slice counts), got {entry!r}"
            )
    return data


def apply_strategies(model, strategies, source="strategies"):
    """``shard()`` each module the mapping names; returns the module names sharded."""
    modules = dict(model.named_modules())
    done = []
    for pattern, entry in strategies.items():
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            raise ValueError(
                f"{source}: {pattern!r} names no module of {type(model).__name__} (modules: "
                f"{[n for n in modules if n][:12]}...)"
            )
        params = {k: tuple(v) for k, v in entry.items() if k not in _IO}
        io = {
            k: None if entry.get(k) is None else tuple(_strategy(s) for s in entry[k]) for k in _IO
        }
        for name in names:
            shard(modules[name], io["in_strategy"], io["out_strategy"], parameter_plan=params)
            done.append(name)
    return done


def _strategy(s):
    return None if s is None else tuple(s)
