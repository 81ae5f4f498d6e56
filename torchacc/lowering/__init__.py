"""ATen -> JAX lowering rules. Importing this package fills ``registry.RULES``.

Files are grouped by op family; each rule is one decorated function (see registry.py).
"""

from torchacc import _jaxconfig  # noqa: F401  (x64 before any rule runs)
from torchacc.lowering.registry import RULES, lookup, register  # noqa: F401

_FAMILIES = (
    "pointwise",
    "reduction",
    "shape",
    "factory",
    "nn",
    "nn_backward",
    "optim",
    "amp",
    "prims",
    "special",
    "order",
    "scatter",
    "pooling",
    "resize",
    "distance",
    "fused",
    "fused_attention",
    "memory",
    "linalg",
    "fft",
    "bessel",
    "segments",
    "metas",
    "scan",
    "region",
    "rnn_cells",
)


def _load_families():
    import importlib

    for name in _FAMILIES:
        try:
            importlib.import_module(f"torchacc.lowering.{name}")
        except ModuleNotFoundError as exc:  # a family not written yet
            if exc.name != f"torchacc.lowering.{name}":
                raise
    importlib.import_module("torchacc.sharding.rules")  # the engine's lowering half


_load_families()
