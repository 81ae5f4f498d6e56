"""Stage: the graph IR (Note [Values, storages and views] in graph.py)."""

from torchacc.ir.graph import (  # noqa: F401
    Node,
    OpEntry,
    ScalarSlot,
    Storage,
    TensorSlot,
    Value,
    contiguous_desc,
    desc_of,
    fill,
    live_storages,
)
