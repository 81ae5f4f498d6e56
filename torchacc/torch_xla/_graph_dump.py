"""torch_xla's graph dumps: with ``XLA_SAVE_TENSORS_FILE`` set, every sync that runs a graph
appends it to ``<XLA_SAVE_TENSORS_FILE>.<ordinal>``, in torch_xla's layout.

``XLA_SAVE_TENSORS_FMT`` picks the form: ``text`` (default; the IR text of
``_get_xla_tensors_text``), ``hlo`` (the program's HLO, ``_get_xla_tensors_hlo``, followed by
the outputs' shardings between ``#OUTPUT_SHARDING_BEGIN`` and ``#OUTPUT_SHARDING_END``: the
layouts the run gave them) or ``stablehlo``. One entry::

    [ScheduleSyncTensorsGraph]
    TensorsGraphInfo:
      <function> (<file>:<line>)        the Python frames of the sync, innermost first

    Root Hashes: (<hash>)

    ## BEGIN_GRAPH
    <the graph>

    Graph Hash: <hash>

    ## END_GRAPH

Installed when the ``torch_xla`` alias is imported with the variable set (torch_xla reads it
once, too); nothing is observed otherwise.
"""

from __future__ import annotations

import hashlib
import os
import traceback
import warnings

_FORMATS = ("text", "hlo", "stablehlo")
_installed = [False]
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # torchacc/


def install():
    """Observe syncs when ``XLA_SAVE_TENSORS_FILE`` is set (once per process)."""
    path = os.environ.get("XLA_SAVE_TENSORS_FILE", "")
    if not path or _installed[0]:
        return
    fmt = os.environ.get("XLA_SAVE_TENSORS_FMT", "text").strip().lower() or "text"
    if fmt not in _FORMATS:
        warnings.warn(
            f"torchacc: XLA_SAVE_TENSORS_FMT={fmt!r} is not supported (torchacc writes "
            f"{', '.join(_FORMATS)}); the graphs are saved as text",
            stacklevel=2,
        )
        fmt = "text"
    from torchacc.engine import execute

    def observer(outputs):
        return _dump(f"{path}.0", fmt, outputs)

    _installed[0] = observer
    execute.observe_graphs(observer)


def uninstall():
    """Stop saving graphs (what :func:`install` started)."""
    from torchacc.engine import execute

    if _installed[0]:
        execute._graph_observers.remove(_installed[0])
        _installed[0] = False


def _frames():
    stack = traceback.extract_stack()
    lines = []
    for frame in reversed(stack):
        if os.path.abspath(frame.filename).startswith(_HERE):
            continue  # torchacc's own frames: torch_xla lists the user's Python frames
        lines.append(f"  {frame.name} ({frame.filename}:{frame.lineno})\n")
    return "".join(lines)


def _hash(text):
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _dump(path, fmt, outputs):
    """Write the graph of the pending ``outputs``; return what writes its end once it ran."""
    from torchacc.torch_xla import _xlac_text as form

    if fmt == "text":
        graph = form.graph_text(outputs)
    elif fmt == "hlo":
        graph = form.graph_hlo(outputs)
    else:
        import jax

        fn, args, _ = form.program_of_values(outputs)
        graph = jax.jit(fn).lower(*args).as_text()
    roots = ", ".join(_hash(f"{graph}#{i}") for i in range(len(outputs)))
    with open(path, "a") as f:
        f.write(
            f"[ScheduleSyncTensorsGraph]\nTensorsGraphInfo:\n{_frames()}\n"
            f"Root Hashes: ({roots})\n\n## BEGIN_GRAPH\n{graph}\n"
        )
    shapes = [form._desc_text(v.desc) for v in outputs]

    def end():
        text = f"Graph Hash: {_hash(graph)}\n\n## END_GRAPH\n\n"
        if fmt == "hlo":
            lines = "".join(f"{s} {_sharding_text(v)}\n" for s, v in zip(shapes, outputs))
            text += f"\n#OUTPUT_SHARDING_BEGIN\n\n{lines}\n#OUTPUT_SHARDING_END\n\n"
        with open(path, "a") as f:
            f.write(text)

    return end


def _sharding_text(value):
    """The layout the run gave ``value``, in torch_xla's text form (``{replicated}`` when it is
    on one device or every device holds all of it)."""
    from torchacc.sharding import api as engine

    array = value.buf if value.node is None and type(value.buf) is not tuple else None
    sharding = getattr(array, "sharding", None)
    return engine.hlo_text(sharding, len(value.desc[0])) or "{replicated}"
